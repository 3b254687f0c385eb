"""What the OpenAI-compatible endpoint costs an episode, and how many agents it holds at once.

Three measurements on the tiny model and the native engine (an engine worker
thread, as in a run; the endpoint served on the episode runner's loop):
1. Per-call overhead: what the endpoint adds to a call (HTTP both ways, the
   openai client, JSON, the chat template, tokenising, the prefix match,
   tool-call parsing), measured with an engine that answers at once with a
   fixed 16-token tool call, so no engine time hides in it: ``--calls``
   two-call episodes (a first call, then one that continues it with a tool
   result), p50 / p99 per call, and the process's CPU time per call (client
   and server; a busy machine does not inflate it). For context, one-call
   episodes on the real engine, in process (``run_episode``, the engine call
   timed inside the episode) and through the endpoint (timed by the
   client), taken in turn so that other load slows both alike, p50 each.
2. Trained samples/s of ``recipes/openai_agent.yaml`` (the agent through the
   endpoint) vs ``recipes/tool_use.yaml`` (the same task played in process),
   both shortened to ``--steps`` RL steps after ``--sft`` warm-start steps of
   16 episodes (the RL phase's samples/s, as ``summary.json`` reports it).
3. ``--concurrent`` (256) agent episodes of two calls each, all at once
   (``env.concurrency`` = that many): failures, wall time, episodes/s.

Appends one record to benchmarks/results/ (workload ``agent_endpoint``).

    python benchmarks/agent_endpoint.py [--calls 200] [--concurrent 256] [--steps 10] [--sft 100]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*` when run as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "episodes"))

from benchmarks.harness import append_record  # noqa: E402
from conveyor.data.tiny import build_model, build_tokenizer  # noqa: E402
from conveyor.env.api import StepResult  # noqa: E402
from conveyor.env.calculator_agent import client_for  # noqa: E402
from conveyor.episodes.multi_turn import EpisodeLimits  # noqa: E402
from conveyor.episodes.openai_server import Endpoint, EndpointSettings  # noqa: E402
from conveyor.rollout.api import Completion, SamplingParams  # noqa: E402
from conveyor.types import Task  # noqa: E402

import agent_rig  # noqa: E402  (the tests' runner + endpoint + engine thread)

ROOT = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class OneTurn:
    """An in-process environment whose episode is one model turn."""

    def reset(self, task):
        return task.prompt

    def step(self, action):
        return StepResult("", 0.0, True)


def paired_ms(tok, model, calls: int) -> tuple[list[float], list[float]]:
    """One-call episodes on the real engine, in process and through the endpoint, one of each in turn
    (two runners, each with its engine thread), so that a busy machine slows both alike."""
    local = agent_rig.Rig(model, tok, env=OneTurn, concurrency=1)  # the same runner and engine, no endpoint
    remote = agent_rig.Rig(model, tok, _one_call, concurrency=1)
    try:
        a, b = [], []
        for i in range(calls):
            (traj,) = local.play([Task(f"t{i}", "6*7=")])
            a.append(traj.timings["generate_s"] * 1e3)
            (traj,) = remote.play([Task(f"t{i}", "6*7=")])
            b.append(traj.reward_info["call_ms"])
        return a, b
    finally:
        local.close()
        remote.close()


async def _one_call(base_url, api_key, task):
    c = client_for(base_url, api_key)  # one connection pool for all episodes, as a real agent would keep
    t0 = time.perf_counter()
    await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.prompt}])
    return {"reward": 0.0, "call_ms": (time.perf_counter() - t0) * 1e3}


class Instant:
    """A TurnEngine that answers at once with a fixed reply."""

    def __init__(self, tok, text: str):
        self.text, self.ids = text, list(tok(text, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]

    async def generate(self, ids, params) -> Completion:
        n = len(self.ids)
        return Completion(list(self.ids), [-0.1] * n, [0] * n, "stop", self.text)


async def _overhead(tok, calls: int) -> tuple[list[float], float]:
    """Wall ms of each call, and the process's CPU ms per call (client and server together: a number a
    busy machine does not inflate)."""
    from openai import AsyncOpenAI
    limits = EpisodeLimits(4, 400, 64, agent_rig.CONTEXT)
    endpoint = Endpoint(tok, EndpointSettings(tool_format="plain", tools_in_prompt=False), limits, lambda _: None)
    await endpoint.start(Instant(tok, agent_rig.CALL))
    shared = AsyncOpenAI(base_url=endpoint.base_url, api_key="unset", max_retries=0)
    params = SamplingParams(max_new_tokens=24)
    out = []
    cpu0 = time.process_time()
    for i in range(calls):
        ep = endpoint.open(Task(f"o{i}", "6*7="), params)
        c = shared.with_options(api_key=ep.key)
        msgs = [{"role": "user", "content": "6*7="}]
        for _ in range(2):
            t0 = time.perf_counter()
            r = await c.chat.completions.create(model="policy", messages=msgs, tools=[agent_rig.CALCULATOR])
            out.append((time.perf_counter() - t0) * 1e3)
            call = r.choices[0].message.tool_calls[0]
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        assert ep.transcript.rewrites == 0 and ep.transcript.calls == 2
        endpoint.close(ep.key)
    cpu_ms = (time.process_time() - cpu0) * 1e3 / len(out)
    await shared.close()
    await endpoint.stop()
    return out, cpu_ms


async def _two_calls(base_url, api_key, task):
    c = client_for(base_url, api_key)
    msgs = [{"role": "user", "content": task.prompt}]
    for _ in range(2):
        r = await c.chat.completions.create(model="policy", messages=msgs, tools=[agent_rig.CALCULATOR])
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    return 1.0


def concurrent(tok, model, n: int) -> dict:
    rig = agent_rig.Rig(model, tok, _two_calls, concurrency=n, episode_timeout_s=600)
    try:
        t0 = time.perf_counter()
        out = rig.play([Task(f"c{i}", "6*7=") for i in range(n)], timeout_s=1200)
        wall = time.perf_counter() - t0
        counts = rig.pool.counts()
    finally:
        rig.close()
    failed = sum(o is None for o in out)
    return {"concurrent_episodes": n, "concurrent_failed": failed, "concurrent_wall_s": wall,
            "concurrent_episodes_per_s": n / wall, "concurrent_calls": counts.get("agent_calls", 0),
            "concurrent_bad_requests": counts.get("bad_requests", 0)}


def samples_per_s(recipe: str, steps: int, sft: int) -> float:
    from conveyor.api import load_config, train
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(ROOT / "recipes" / recipe, [f"loop.steps={steps}", f"sft.steps={sft}", "sft.batch_size=16",
                                                     "data.eval_size=16",
                                                     "loop.eval_sampled=false", "loop.eval_every=0",
                                                     "observe.progress=false", "observe.tensorboard=false"])
        summary = train(cfg, Path(d) / "run")
    return float(summary.raw["trained_samples_per_second"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--concurrent", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sft", type=int, default=100)
    args = ap.parse_args()
    tok = build_tokenizer()
    model = build_model(tok, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384,
                        max_position_embeddings=agent_rig.CONTEXT).eval()
    over, cpu_ms = asyncio.run(_overhead(tok, args.calls))
    local, remote = paired_ms(tok, model, max(20, args.calls // 4))
    metrics = {"calls": len(over), "overhead_ms_p50": pct(over, 0.5), "overhead_ms_p99": pct(over, 0.99),
               "overhead_ms_mean": statistics.fmean(over), "overhead_cpu_ms_per_call": cpu_ms,
               "load_average_1m": os.getloadavg()[0],
               "in_process_call_ms_p50": pct(local, 0.5), "endpoint_call_ms_p50": pct(remote, 0.5),
               "paired_difference_ms_p50": pct([r - l for l, r in zip(local, remote)], 0.5)}
    print(f"endpoint overhead per call: p50 {metrics['overhead_ms_p50']:.2f} ms, p99 "
          f"{metrics['overhead_ms_p99']:.2f} ms, CPU {cpu_ms:.2f} ms ({len(over)} calls, load average "
          f"{metrics['load_average_1m']:.1f}); a call on the real engine p50: in process "
          f"{metrics['in_process_call_ms_p50']:.1f} ms, through the endpoint {metrics['endpoint_call_ms_p50']:.1f} ms")
    metrics.update(concurrent(tok, model, args.concurrent))
    print(f"{args.concurrent} concurrent two-call agent episodes: {metrics['concurrent_failed']} failed, "
          f"{metrics['concurrent_wall_s']:.1f} s ({metrics['concurrent_episodes_per_s']:.1f} episodes/s)")
    if args.steps > 0:
        agent = samples_per_s("openai_agent.yaml", args.steps, args.sft)
        local_sps = samples_per_s("tool_use.yaml", args.steps, args.sft)
        metrics.update({"samples_per_s_openai_agent": agent, "samples_per_s_in_process": local_sps,
                        "samples_per_s_ratio": agent / local_sps, "steps": args.steps, "sft_steps": args.sft})
        print(f"trained samples/s: openai agent {agent:.2f}, in process (tool_use) {local_sps:.2f} "
              f"({agent / local_sps:.2f}x)")
    print("appended to", append_record("agent_endpoint", metrics, config=vars(args), gpu=False))


if __name__ == "__main__":
    main()
