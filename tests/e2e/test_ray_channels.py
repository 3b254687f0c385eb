"""benchmarks/ray_channels.py at a tiny shape on the session's two-node loopback cluster: every
route delivers the whole payload to the receivers on the other node (its asserts), and every
number it reports is a measured, positive time or rate."""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.ray_channels import measure

pytestmark = pytest.mark.slow  # a Ray cluster


def test_ray_channels_measures_every_route_to_the_other_node(cluster):
    import ray
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        args = argparse.Namespace(resource="node_b", samples=4, tokens=32, receivers=2, repeat=2, messages=20)
        rec = measure(args)
    finally:
        ray.shutdown()
    assert rec["other_node"] is True
    for name in ("trajectories", "batch"):
        r = rec[name]
        assert r["bytes"] > 4 * 32  # at least a byte per token of the 4 samples
        for k in ("arg_s", "ref_s", "tcp_s", "arg_return_s", "tcp_return_s"):
            assert 0 < r[k] < 30 and math.isfinite(r[k]), (name, k, r[k])
    t, a = rec["tasks"], rec["answers"]
    assert t["ray_calls_per_s"] > 0 and t["tcp_msgs_per_s"] > 0 and t["ray_cpu_ms_per_msg"] > 0
    assert a["ray_answers_per_s"] > 0 and a["ray_cpu_ms_per_answer"] > 0
    assert a["tcp_answers_per_s"] > 0 and a["tcp_cpu_ms_per_answer"] > 0
