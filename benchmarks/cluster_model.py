"""A simple analytic model of streaming RL throughput on a cluster, and what saturates first.

The model (docs/cluster.md explains it): with T trainer GPUs and E engine
GPUs, streaming at staleness >= 2 runs at

    samples/s = min(E * e, T * t * eff(T), 1 / per-sample cost of the shared paths)

where ``e`` and ``t`` are one engine GPU's and one trainer GPU's samples/s
for the model, ``eff(T)`` the FSDP scaling efficiency, and the shared paths
are the ones every sample or step crosses once: the weight broadcast (one
per step, overlapped with the next step up to the trainer's step time), the
batch sent to every trainer rank from the controller, and the controller's
messages (a Generate and a Done per chunk, at the driver CPU per message
measured by ``benchmarks/ray_channels.py``). Calibrated on the two-GPU
streaming row of benchmarks/w1.md (H100, 0.5B shape, s=2: 246 samples/s,
engine and trainer both busy), checked against the other measured rows
(1, 2 and 4 GPUs; printed with the error), then projected to 8-1024 GPUs
for 0.5B, 7B and 70B models with the hardware constants below (each named;
change them for your cluster). It runs nothing; it prints.

    python benchmarks/cluster_model.py
"""
from __future__ import annotations

from dataclasses import dataclass

# ---- measured (benchmarks/w1.md, NVIDIA H100 80GB HBM3, 0.5B shape, W1 batch) -------------
SAMPLES_PER_STEP = 256
TOKENS_PER_SAMPLE = 102_000 / 256          # prompt 128 + completion, the trainer's tokens
COMPLETION_TOKENS = 63_552 / 246           # rollout tok/s / samples/s in the 2-GPU s=2 row
E_05B = 63_552 / COMPLETION_TOKENS         # engine GPU, samples/s (s=2 row: engine idle 0.0%)
T_05B = 96_585 / TOKENS_PER_SAMPLE         # trainer GPU, samples/s (same row, MFU 35.8%)
FSDP_TOK_S_PER_GPU = {1: 96_585, 2: 108_483 / 2, 3: 128_426 / 3}  # 4-GPU table: 2+2 and 3+1 rows
PUBLISH_GATHER_S_PER_GB = 0.0385 / 0.99    # FSDP ranks' bucketed gather at publish: 36-41 ms at 0.99 GB
NVLINK_BCAST_GBS = 332.0                   # NCCL broadcast GPU to GPU, 512 MiB buckets (p2p table)

# ---- measured on this code's Ray path (benchmarks/ray_channels.py, docs/cluster.md) ----------
# The controller's CPU per message, every thread of the driver process (Ray's own included), on
# the engines' direct TCP channel (launch/ray_channel.py): one Generate of a group sent, one Done
# of its 8 completions received (its cost grows with the completion tokens: 0.50 ms for 8 x 896).
# AMD EPYC, 2 cores, a two-node loopback cluster, under the CPU lock (docs/cluster.md).
DRIVER_CPU_S_PER_TASK = 0.033e-3
DRIVER_CPU_S_PER_ANSWER_TOKEN = 0.499e-3 / (8 * 896)
# The same by actor calls (a call per Generate, Dones returned by pulls of 16): what the launcher
# did before the channel.
CALL_CPU_S_PER_TASK = 0.285e-3
CALL_CPU_S_PER_ANSWER_TOKEN = 0.975e-3 / (8 * 896)
DRIVER_OTHER_S_PER_SAMPLE = 0.0  # the producer's own work per sample (groups, reward submit): not measured

# ---- assumed hardware (not measured here) ---------------------------------------------------
NET_GBS = 45.0            # one 400 Gb/s InfiniBand/RoCE NIC per GPU, effective
DRIVER_NET_GBS = 10.0     # the controller's host NIC share for the batch
GPUS_PER_NODE = 8
BATCH_BYTES_PER_TOKEN = 24  # ids int64 + loss mask + behaviour logprob + advantage (+ version)
CHUNK = 8                 # samples per Generate (one task's group)
BUCKET_GB = 0.128         # launch.weight_bucket_mb


@dataclass(frozen=True)
class Model:
    name: str
    params_b: float

    @property
    def weight_gb(self) -> float:  # bf16
        return 2 * self.params_b

    def per_gpu(self, rate_05b: float) -> float:
        # Compute per sample scales with parameters (6N per token); small models are host-bound, so
        # this is optimistic for 7B/70B relative to 0.5B only by the MFU difference (ignored).
        return rate_05b * 0.494 / self.params_b


def eff(ranks: int) -> float:
    """FSDP per-GPU efficiency vs one GPU: measured for 1-3 ranks (0.5B, host-bound), then held."""
    return FSDP_TOK_S_PER_GPU[min(ranks, 3)] / FSDP_TOK_S_PER_GPU[1]


def controller_s(batch: int, calls: bool = False) -> float:
    """The controller's seconds of CPU per step for its messages: a Generate and a Done per chunk
    (``calls``: by actor calls instead of the channel). One Python driver does them one at a time
    (the GIL), so they cannot overlap each other."""
    task, token = (CALL_CPU_S_PER_TASK, CALL_CPU_S_PER_ANSWER_TOKEN) if calls else \
        (DRIVER_CPU_S_PER_TASK, DRIVER_CPU_S_PER_ANSWER_TOKEN)
    return (batch / CHUNK) * (task + CHUNK * COMPLETION_TOKENS * token) + batch * DRIVER_OTHER_S_PER_SAMPLE


def controller_limit(calls: bool = False) -> float:
    """The samples/s at which the controller's messages take all of one core."""
    return 1.0 / controller_s(1, calls)


def streaming(trainers: int, engines: int, m: Model = Model("0.5B", 0.494), batch: int = SAMPLES_PER_STEP) -> dict:
    engine = engines * m.per_gpu(E_05B)
    trainer = trainers * m.per_gpu(T_05B) * eff(trainers)
    rate = min(engine, trainer)
    step_s = batch / rate
    nodes = max(1, -(-(trainers + engines) // GPUS_PER_NODE))
    bw = NVLINK_BCAST_GBS if nodes == 1 else NET_GBS
    # Pipelined broadcast: the bytes once over the slowest link, plus one bucket per extra hop.
    bcast_s = m.weight_gb / bw + (nodes - 1) * BUCKET_GB / bw + (m.weight_gb * PUBLISH_GATHER_S_PER_GB
                                                                  if trainers > 1 else 0.0)
    batch_s = trainers * batch * TOKENS_PER_SAMPLE * BATCH_BYTES_PER_TOKEN / 1e9 / DRIVER_NET_GBS
    msgs_s = controller_s(batch)
    limits = {"engines": step_s if engine <= trainer else batch / engine,
              "trainer": batch / trainer, "weight broadcast": bcast_s,
              "batch to ranks": batch_s, "controller messages": msgs_s}
    step = max(limits.values())
    return {"samples_s": batch / step, "step_s": step, "limits": limits,
            "first": max(limits, key=limits.get), "nodes": nodes}


def check() -> None:
    print("check against benchmarks/w1.md (H100, 0.5B shape; samples/s, model vs measured):")
    rows = [("2 GPUs, 1 trainer + 1 engine, s=2", streaming(1, 1), 246.0),
            ("4 GPUs, 3 trainer + 1 engine, s=2", streaming(3, 1), 245.0),
            ("4 GPUs, 2 trainer + 2 engines, s=2", streaming(2, 2), 226.0),
            # One GPU shared (older code): roles take turns, so the rates add as times.
            ("1 GPU shared, s=2 (older code)", {"samples_s": 1 / (1 / E_05B + 1 / T_05B), "first": "both"}, 34.7)]
    for name, got, measured in rows:
        err = 100 * (got["samples_s"] - measured) / measured
        print(f"  {name:40s} model {got['samples_s']:7.1f}  measured {measured:6.1f}  ({err:+5.0f}%)"
              f"  bound: {got['first']}")
    print("  (the 2-GPU row calibrates e and t; the 4-GPU rows use the measured FSDP per-GPU rate; the\n"
          "   1-GPU row is older code on a shared card, which the model does not describe: it is an upper bound)")


def project() -> None:
    cap = controller_limit()
    print(f"\nprojection, streaming s>=2, {SAMPLES_PER_STEP} samples/step per 2 GPUs "
          f"({GPUS_PER_NODE} GPUs/node, NIC {NET_GBS:.0f} GB/s, controller NIC {DRIVER_NET_GBS:.0f} GB/s, "
          f"controller {1e3 * controller_s(CHUNK):.2f} ms CPU per chunk of {CHUNK} samples of "
          f"{COMPLETION_TOKENS:.0f} completion tokens: at most {cap:,.0f} samples/s; by actor calls "
          f"{1e3 * controller_s(CHUNK, calls=True):.2f} ms, {controller_limit(calls=True):,.0f} samples/s):")
    for m in (Model("0.5B", 0.494), Model("7B", 7.0), Model("70B", 70.0)):
        for gpus in (8, 64, 512, 1024):
            # Split the GPUs so engines and trainer ranks are equally fast (streaming's best split).
            t_gpu = m.per_gpu(T_05B) * eff(3)
            trainers = max(1, round(gpus * m.per_gpu(E_05B) / (m.per_gpu(E_05B) + t_gpu)))
            batch = SAMPLES_PER_STEP * gpus // 2  # a step's batch grows with the cluster (fixed per GPU)
            r = streaming(trainers, gpus - trainers, m, batch)
            lim = ", ".join(f"{k} {v:.3g}s" for k, v in r["limits"].items())
            print(f"  {m.name:4s} {gpus:5d} GPUs ({trainers} trainer + {gpus - trainers} engine, {r['nodes']} nodes): "
                  f"{r['samples_s']:9.0f} samples/s, step {r['step_s']:.3g}s, first limit: {r['first']}\n"
                  f"        [{lim}]")
        # samples/s per GPU that the roles' compute allows at the balanced split (the last row's)
        rate = batch / max(r["limits"]["engines"], r["limits"]["trainer"]) / gpus
        print(f"        the controller's messages take a whole core at about {cap / rate:,.0f} GPUs "
              f"({cap:,.0f} samples/s) for {m.name}; by actor calls at {controller_limit(True) / rate:,.0f}")


if __name__ == "__main__":
    check()
    project()
