"""Subprocess entry points, one per system: ``python -m benchmarks.peers.<system>_peer SPEC.json``.

Contract shared by every peer: read the run spec (``workloads.py``), train
under ``workloads.run_config(spec)``, and leave in ``spec["run_dir"]``:
``metrics.jsonl`` (one ``kind == "train"`` line per rollout batch, i.e.
per conveyor loop step, with the phase times ``metrics.py`` reads), ``trajectories.jsonl`` (written by the
recording reward), and ``result.json`` (machine, versions, steps, RL
seconds, RL start time, W2 evaluations before and after). A peer that
raises exits non-zero; the harness turns that into a failed row.

The peers know nothing of tables, sweeps or other peers.
"""
