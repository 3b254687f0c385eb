"""The performance protocol of ../shared/BENCHMARKS.md as runnable harnesses.

Contract: ``w1_throughput.py`` (systems throughput) and ``w2_learning.py``
(learning) each run every configuration (system x setting x seed) in its own
subprocess with a deadline, write one JSON per configuration and append one
markdown row per configuration. The metrics are computed by ``metrics.py``
from the same two files for every system (per-step phase times in
``metrics.jsonl`` and per-trajectory records in ``trajectories.jsonl``), so a
number means the same thing whichever system produced it.

This package is not part of the installed ``conveyor`` library: it imports
conveyor and, for the peer, TRL; conveyor never imports it.
"""
