"""Data over Ray: actor call arguments and returns, ``ray.put`` object refs, or a direct TCP channel.

Three payloads cross from the driver (the controller) to an actor on another
node and back, each by three routes, and the controller's cost per small
message is measured:

- ``trajectories``: ``--samples`` ``Trajectory`` objects of ``--tokens``
  tokens (prompt 1/8, completion 7/8; tuples of Python numbers, as the
  producer holds them);
- ``batch``: the trainer's ``Batch`` for them (int64 ids, float32 mask,
  advantages and behaviour logprobs: what a train step sends every rank);
- ``tasks``: a ``Generate`` of one group (a prompt of 1/8 ``--tokens``, 8
  samples), the message the controller sends per chunk; and its answer, a
  ``Done`` of 8 completions, which the controller pulls from the engine.

Routes: ``arg`` (the payload as an actor call's argument: Ray inlines a small
one, puts a large one in the object store for the call; returned by
``give()``), ``ref`` (``ray.put`` once, the ref to ``--receivers`` actors:
what ``RayTrainerProxy`` does for the batch), ``tcp`` (pickled over a
``multiprocessing.connection`` socket the actor listens on, no Ray in the
path). For each: the median seconds of ``--repeat`` one-way sends (driver ->
actor, acknowledged) and of returns (actor -> driver), and MB/s. For tasks:
the rate the driver sustains sending ``--messages`` of them back to back
(``calls/s``) and the driver's CPU seconds per message (every thread of this
process: Ray's own included), by an actor call each and over the channel;
for answers, the rate and driver CPU per ``Done`` taken by pulls of 16
(actor-call returns) and sent one by one over the channel.

    python benchmarks/ray_channels.py --loopback            # a two-node cluster on this machine
    python benchmarks/ray_channels.py --address HEAD:6379 --resource node_b   # a real one
    python benchmarks/ray_channels.py --loopback --samples 8 --tokens 64 --repeat 2 --messages 50  # tiny

``--resource R`` pins the receiving actors to nodes that have the custom
resource R (``--loopback`` starts one node with ``node_a`` and the other with
``node_b``, and pins to ``node_b``). Appends a record to
``benchmarks/results/ray_channels_cpu.jsonl``.
"""
from __future__ import annotations

import argparse
import os
import pickle
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script

AUTH = b"conveyor-ray-channels"


def trajectories(n: int, tokens: int) -> list:
    from conveyor.types import Task, Trajectory
    rng = random.Random(0)
    p = max(1, tokens // 8)
    c = tokens - p
    return [Trajectory(Task(f"t{i}", "q", "a"), tuple(rng.randrange(32000) for _ in range(p)),
                       tuple(rng.randrange(32000) for _ in range(c)), tuple(-rng.random() for _ in range(c)),
                       (3,) * c, (1,) * c, text="x" * c, reward=1.0) for i in range(n)]


def batch(n: int, tokens: int):
    import torch

    from conveyor.types import Batch
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 32000, (tokens,), generator=g) for _ in range(n)]
    return Batch(ids, [torch.ones(tokens) for _ in range(n)],
                 {"advantages": [torch.randn(tokens, generator=g) for _ in range(n)],
                  "behaviour_logprobs": [-torch.rand(tokens, generator=g) for _ in range(n)]})


def tasks(tokens: int):
    """One group's chunk: a prompt of 1/8 ``tokens``, 8 samples."""
    from conveyor.rollout.api import SamplingParams
    from conveyor.transport.messages import Generate
    rng = random.Random(1)
    prompt = [rng.randrange(32000) for _ in range(max(1, tokens // 8))]
    return Generate(0, [prompt], SamplingParams(temperature=1.0, max_new_tokens=tokens, n=8), version=3)


def done(tokens: int):
    """Its answer: 8 completions of 7/8 ``tokens``, with logprobs and versions."""
    from conveyor.rollout.api import Completion
    from conveyor.transport.messages import Done, EngineClock
    rng = random.Random(2)
    c = tokens - max(1, tokens // 8)
    group = [Completion([rng.randrange(32000) for _ in range(c)], [-rng.random() for _ in range(c)], [3] * c,
                        "stop", "x" * c) for _ in range(8)]
    return Done(0, 0, [group], EngineClock(1.0, 0.1, {"decode_steps": 10.0}))


def size(payload) -> int:
    """Items received: forces the receiver to hold the whole payload."""
    return len(payload)


class Peer:
    """The receiving end: takes payloads by call, by ref, or on its TCP channel; gives them back.
    (An actor class once ``measure`` wraps it: Ray is imported only after ``--loopback`` set the
    environment it reads.)"""

    def __init__(self):
        self._held = None
        self._seen = 0

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def hold(self, payload) -> int:
        self._held = payload
        return size(payload)

    def take(self, payload) -> int:
        return size(payload)

    def give(self):
        return self._held

    def send(self, seq: int, message) -> None:
        self._seen += 1

    def seen(self) -> int:
        return self._seen

    def fill(self, message, n: int, most: int) -> None:
        """``n`` answers to pull, ``most`` at a time: distinct objects (a list of one object ``most``
        times would be pickled once)."""
        self._answers = [pickle.loads(pickle.dumps(message)) for _ in range(most)]
        self._left = n

    def pull(self, most: int) -> list:
        k = min(most, self._left)
        self._left -= k
        return self._answers[:k]

    def listen(self) -> tuple[str, int]:
        """Serve one TCP connection in a thread: a payload is acknowledged with its size, "give"
        answers the held payload, "seen" the messages counted so far, None ends it."""
        import ray
        listener = Listener((ray.util.get_node_ip_address(), 0), authkey=AUTH)

        def serve() -> None:
            with listener, nodelay(listener.accept()) as conn:
                while (msg := recv(conn)) is not None:
                    if isinstance(msg, str) and msg == "give":
                        send(conn, self._held)
                    elif isinstance(msg, str) and msg == "seen":
                        send(conn, self._seen)
                    elif isinstance(msg, tuple) and msg and msg[0] == "task":
                        self._seen += 1
                    elif isinstance(msg, tuple) and msg and msg[0] == "emit":  # n answers, one message each
                        for _ in range(msg[2]):
                            send(conn, msg[1])
                    else:
                        send(conn, size(msg))
        threading.Thread(target=serve, daemon=True).start()
        return listener.address


def nodelay(conn):
    """No Nagle delay on the channel's socket (an acknowledged send would wait for a delayed ACK)."""
    s = socket.socket(fileno=os.dup(conn.fileno()))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.close()
    return conn


def send(conn, obj) -> None:
    """Plain pickle (``Connection.send`` would use torch's shared-memory reductions for tensors,
    which cannot cross nodes)."""
    conn.send_bytes(pickle.dumps(obj, protocol=5))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def transfers(peers: list, conns: list, payload, repeat: int) -> dict:
    """One-way seconds (to every receiver, acknowledged) and return seconds, per route."""
    import ray
    want = size(payload)
    assert ray.get(peers[0].hold.remote(payload)) == want

    def by_arg():
        assert ray.get([p.take.remote(payload) for p in peers]) == [want] * len(peers)

    def by_ref():
        ref = ray.put(payload)
        assert ray.get([p.take.remote(ref) for p in peers]) == [want] * len(peers)

    def by_tcp():
        for c in conns:
            send(c, payload)
        assert [recv(c) for c in conns] == [want] * len(conns)

    def back_tcp():
        send(conns[0], "give")
        assert size(recv(conns[0])) == want
    return {"arg_s": timed(by_arg, repeat), "ref_s": timed(by_ref, repeat), "tcp_s": timed(by_tcp, repeat),
            "arg_return_s": timed(lambda: size(ray.get(peers[0].give.remote())), repeat),
            "tcp_return_s": timed(back_tcp, repeat), "bytes": len(pickle.dumps(payload, protocol=5))}


def message_rate(peer, conn, message, n: int) -> dict:
    """Back-to-back sends of ``message``: calls/s and driver CPU seconds per message, per route."""
    import ray
    out = {}
    base = ray.get(peer.seen.remote())
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        peer.send.remote(i, message)
    assert ray.get(peer.seen.remote()) == base + n  # an actor's calls from one caller run in order
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out["ray_calls_per_s"], out["ray_cpu_ms_per_msg"] = n / wall, 1e3 * cpu / n
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        send(conn, ("task", i, message))
    send(conn, "seen")
    assert recv(conn) == base + 2 * n
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out["tcp_msgs_per_s"], out["tcp_cpu_ms_per_msg"] = n / wall, 1e3 * cpu / n
    out["ray_roundtrip_ms"] = 1e3 * timed(lambda: ray.get(peer.seen.remote()), 50)
    return out


def answer_rate(peer, conn, answer, n: int, most: int = 16) -> dict:
    """``n`` answers taken by pulls of up to ``most`` actor-call returns, and ``n`` sent one by one
    over the channel: answers/s and driver CPU seconds per answer, per route."""
    import ray
    ray.get(peer.fill.remote(answer, n, most))
    got, c0, t0 = 0, time.process_time(), time.perf_counter()
    while got < n:
        got += len(ray.get(peer.pull.remote(most)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = {"ray_answers_per_s": n / wall, "ray_cpu_ms_per_answer": 1e3 * cpu / n}
    c0, t0 = time.process_time(), time.perf_counter()
    send(conn, ("emit", answer, n))
    for _ in range(n):
        recv(conn)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out["tcp_answers_per_s"], out["tcp_cpu_ms_per_answer"] = n / wall, 1e3 * cpu / n
    return out


def measure(args) -> dict:
    import ray
    actor = ray.remote(num_cpus=0, max_concurrency=1)(Peer)
    opts = {"resources": {args.resource: 0.001}} if args.resource else {}
    peers = [actor.options(**opts).remote() for _ in range(args.receivers)]
    nodes = ray.get([p.node.remote() for p in peers])
    driver = ray.get_runtime_context().get_node_id()
    conns = [nodelay(Client(tuple(addr), authkey=AUTH)) for addr in ray.get([p.listen.remote() for p in peers])]
    try:
        rec = {"other_node": all(n != driver for n in nodes)}
        for name, payload in (("trajectories", trajectories(args.samples, args.tokens)),
                              ("batch", batch(args.samples, args.tokens))):
            rec[name] = transfers(peers, conns, payload, args.repeat)
        rec["tasks"] = message_rate(peers[0], conns[0], tasks(args.tokens), args.messages)
        rec["answers"] = answer_rate(peers[0], conns[0], done(args.tokens), args.messages)
        return rec
    finally:
        for c in conns:
            send(c, None)
            c.close()
        for p in peers:
            ray.kill(p)


def report(rec: dict, args) -> None:
    print(f"{args.samples} samples x {args.tokens} tokens, {args.receivers} receiver(s) "
          f"{'on another node' if rec['other_node'] else 'on the driver node'}, median of {args.repeat}:")
    for name in ("trajectories", "batch"):
        r = rec[name]
        mb = r["bytes"] / 1e6
        print(f"  {name:12s} {mb:7.1f} MB  arg {r['arg_s'] * 1e3:8.1f} ms  ref {r['ref_s'] * 1e3:8.1f} ms  "
              f"tcp {r['tcp_s'] * 1e3:8.1f} ms  | return: arg {r['arg_return_s'] * 1e3:8.1f} ms  "
              f"tcp {r['tcp_return_s'] * 1e3:8.1f} ms")
    t = rec["tasks"]
    a = rec["answers"]
    print(f"  answers (Done of 8 completions): pulled 16 a call {a['ray_answers_per_s']:7.0f}/s "
          f"({a['ray_cpu_ms_per_answer']:.3f} ms driver CPU each), TCP {a['tcp_answers_per_s']:7.0f}/s "
          f"({a['tcp_cpu_ms_per_answer']:.3f} ms)")
    print(f"  tasks (Generate of one group), {args.messages} back to back: Ray calls {t['ray_calls_per_s']:7.0f}/s "
          f"({t['ray_cpu_ms_per_msg']:.3f} ms driver CPU each), TCP {t['tcp_msgs_per_s']:7.0f}/s "
          f"({t['tcp_cpu_ms_per_msg']:.3f} ms); one call's round trip {t['ray_roundtrip_ms']:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="", help="a running Ray cluster (empty: a local Ray, or --loopback)")
    ap.add_argument("--loopback", action="store_true", help="start a two-node cluster on this machine")
    ap.add_argument("--resource", default="", help="custom resource that pins the receivers to their node(s)")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--messages", type=int, default=2000)
    args = ap.parse_args()
    cluster = None
    try:
        if args.loopback:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
            from ray_cluster import RayCluster
            cluster = RayCluster.start(Path(tempfile.mkdtemp(prefix="cvch-", dir="/tmp")), cpus=2)
            os.environ["RAY_AUTH_MODE"] = cluster.env["RAY_AUTH_MODE"]
            args.address, args.resource = cluster.address, args.resource or "node_b"
        import ray
        ray.init(address=args.address or None, log_to_driver=False,
                 **({} if args.address else {"include_dashboard": False, "object_store_memory": 200 * 2**20}))
        try:
            rec = measure(args)
        finally:
            ray.shutdown()  # before the cluster goes: a driver that loses its cluster exits at once
    finally:
        if cluster is not None:
            cluster.stop()
            shutil.rmtree(cluster.root, ignore_errors=True)
    report(rec, args)
    from benchmarks.harness import append_record
    out = append_record("ray_channels", rec, config={k: v for k, v in vars(args).items() if k != "address"} |
                        {"cluster": "loopback" if args.loopback else (args.address or "local")}, gpu=False)
    print(f"appended to {out}")


if __name__ == "__main__":
    main()
