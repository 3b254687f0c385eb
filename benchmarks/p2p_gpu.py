"""How fast the 0.5B configuration's bf16 weights (0.99 GB) move from one GPU to another,
by each path a weight sync can take: NCCL broadcast (as BroadcastWeights sends it, under
several NCCL settings and bucket sizes) and copy-engine peer copies (cudaMemcpyPeer, within
one process and across processes through a CUDA IPC handle). Also a same-GPU copy, the cost
of an engine swapping in a received version. Needs two GPUs; prints one JSON line per path.

  python benchmarks/p2p_gpu.py --out runs/p2p
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

NBYTES = 494_032_768 * 2  # Qwen2.5-0.5B's tensors (tied head listed once), bf16
NCCL_SETTINGS = {
    "default": {},
    "channels32": {"NCCL_MIN_NCHANNELS": "32"},
    "buffsize16M": {"NCCL_BUFFSIZE": str(16 << 20)},
    "channels32+buffsize16M": {"NCCL_MIN_NCHANNELS": "32", "NCCL_BUFFSIZE": str(16 << 20)},
    "p2p_cuda_memcpy": {"NCCL_P2P_USE_CUDA_MEMCPY": "1"},
}


def _timed(fn, reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` runs after two warm-ups, synchronised on the host."""
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def _buckets(bucket_mb: float, device) -> list[torch.Tensor]:
    n, cap = NBYTES // 2, int(bucket_mb * 2**20) // 2
    return [torch.ones(min(cap, n - i), dtype=torch.bfloat16, device=device) for i in range(0, n, cap)]


def _nccl_rank(rank: int, port: int, env: dict, bucket_mb: float, reps: int, q) -> None:
    os.environ.update(env)  # read by NCCL when the communicator is made, below
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    buckets = _buckets(bucket_mb, "cuda")

    def once():
        dist.barrier()
        torch.cuda.synchronize()
        for b in buckets:
            dist.broadcast(b, 0)
    # The barrier is inside the timed region on both ranks alike; it costs ~0.05 ms.
    ms = _timed(once, reps)
    if rank == 1:
        q.put(ms)
    dist.destroy_process_group()


def _ipc_reader(q_in, q_out, bucket_mb: float, reps: int) -> None:
    torch.cuda.set_device(1)
    src = q_in.get()  # on cuda:0, opened from the writer's IPC handle
    dst = torch.empty_like(src, device="cuda:1")
    cap = int(bucket_mb * 2**20) // 2
    pairs = [(dst[i:i + cap], src[i:i + cap]) for i in range(0, src.numel(), cap)]

    def once():
        for d, s in pairs:
            d.copy_(s, non_blocking=True)
    q_out.put(_timed(once, reps))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--settings", nargs="*", default=list(NCCL_SETTINGS))
    ap.add_argument("--bucket-mb", type=float, nargs="*", default=[512.0, 64.0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("p2p_gpu.py needs two visible GPUs")
    ctx = mp.get_context("spawn")
    gbps = lambda ms: NBYTES / (ms * 1e-3) / 1e9  # noqa: E731
    rows = []

    def row(path: str, ms: float, **kw) -> None:
        rows.append({"path": path, "ms": round(ms, 3), "GB_per_s": round(gbps(ms), 1), **kw})
        print(json.dumps(rows[-1]), flush=True)

    local = _buckets(NBYTES / 2**20, "cuda:0")[0]
    other = torch.empty_like(local)
    row("same-GPU copy", _timed(lambda: other.copy_(local), args.reps))
    peer = torch.empty_like(local, device="cuda:1")
    for mb in args.bucket_mb:
        cap = int(mb * 2**20) // 2
        pairs = [(peer[i:i + cap], local[i:i + cap]) for i in range(0, local.numel(), cap)]
        row("peer copy, one process", _timed(lambda: [d.copy_(s, non_blocking=True) for d, s in pairs], args.reps),
            bucket_mb=mb)
    for mb in args.bucket_mb:
        q_in, q_out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_ipc_reader, args=(q_in, q_out, mb, args.reps))
        p.start()
        q_in.put(local)
        row("peer copy, CUDA IPC", q_out.get(timeout=120), bucket_mb=mb)
        p.join(30)
    for name in args.settings:
        for mb in args.bucket_mb:
            q = ctx.Queue()
            env = {"NCCL_NVLS_ENABLE": "0", **NCCL_SETTINGS[name]}
            port = _free_port()
            procs = [ctx.Process(target=_nccl_rank, args=(r, port, env, mb, args.reps, q)) for r in range(2)]
            for p in procs:
                p.start()
            try:
                row("NCCL broadcast", q.get(timeout=120), setting=name, bucket_mb=mb)
            except Exception as e:  # noqa: BLE001 - a setting this NCCL lacks: recorded, not fatal
                row("NCCL broadcast", float("nan"), setting=name, bucket_mb=mb, error=str(e)[:200])
            for p in procs:
                p.join(30)
    from benchmarks.harness import append_record
    append_record("p2p", {"rows": rows}, config={"bytes": NBYTES}, card=torch.cuda.get_device_name(0), gpu=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "p2p.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(0), "bytes": NBYTES, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
