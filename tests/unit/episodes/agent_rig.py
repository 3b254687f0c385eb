"""What the agent-endpoint tests share: a tiny model taught one tool-calling episode, and an episode runner
with the OpenAI-compatible endpoint in front of a real NativeEngine served by engine_loop in a thread.

The model is a 2-layer Llama over the character tokenizer, trained for a few seconds to answer
"6*7=" (with or without a system message) with the call ``calculator(6*7)`` and, after the tool's
answer ``42``, with ``42``: a real model whose tool-calling episode is near-deterministic at T = 1,
so tests can assert what the agent sees.
"""
from __future__ import annotations

import copy
import queue
import threading
import time

import torch

from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.env.agent import AgentEnv
from conveyor.env.chat import render_prompt
from conveyor.env.pool import EnvPool, PoolLimits
from conveyor.episodes.agents import AgentEpisodes
from conveyor.episodes.multi_turn import EpisodeLimits, TurnFormat
from conveyor.episodes.openai_server import Endpoint, EndpointSettings
from conveyor.episodes.runner import EpisodeRunner
from conveyor.launch.roles import ThreadWorker
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.serve import engine_loop
from conveyor.transport.messages import Done, Stop
from conveyor.types import Task

SYSTEM = "Use the calculator."
CALL, ANSWER = "calculator(6*7)", "42"
TASK = Task("six-times-seven", "6*7=", answer="42")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Exact arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
CONTEXT = 512


def ids_of(tok, messages) -> list[int]:
    return list(tok(render_prompt(tok, messages, ()), add_special_tokens=False)["input_ids"])


def taught_model(tok, steps: int = 100):
    """The tiny model, trained on the two policy turns of the episode (the contexts exactly as the
    endpoint records them: the call's EOS stays, the tool's answer follows)."""
    model = build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                        max_position_embeddings=CONTEXT, seed=0)
    eos = tok.eos_token_id
    enc = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    seqs = []
    for system in (None, SYSTEM):
        head = [{"role": "system", "content": system}] if system else []
        first = ids_of(tok, head + [{"role": "user", "content": TASK.prompt}])
        second = ids_of(tok, head + [{"role": "user", "content": TASK.prompt}, {"role": "assistant", "content": CALL},
                                     {"role": "tool", "content": ANSWER}])
        call = enc(CALL)
        suffix = second[len(first) + len(call):]
        seq = first + call + [eos] + suffix + enc(ANSWER) + [eos]
        mask = [0] * len(first) + [1] * (len(call) + 1) + [0] * len(suffix) + [1] * (len(enc(ANSWER)) + 1)
        seqs.append((seq, mask))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    threads = torch.get_num_threads()
    # One thread: on a busy 2-core machine, intra-op threads of these tiny ops wait on each other
    # (measured: 0.2 s for 20 steps on one thread, 22 s on two while other processes ran).
    torch.set_num_threads(1)
    try:
        _fit(model, opt, seqs, steps)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def _fit(model, opt, seqs, steps: int) -> None:
    for _ in range(steps):
        loss = 0.0
        for seq, mask in seqs:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            m = torch.tensor(mask[1:], dtype=torch.float32)
            loss = loss - (logp * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()


class Rig:
    """An engine worker thread, a pump handing turn answers to the runner, and the runner with its endpoint."""

    def __init__(self, model, tok, agent=None, *, env=None, episode_timeout_s: float = 30.0, max_turns: int = 4,
                 concurrency: int = 8, tool_format: str = "plain", tools_in_prompt: bool = False,
                 max_new_tokens: int = 24):
        """``agent``: the function, or AgentEnv's keyword arguments (a program: {"command": [...]});
        or ``env``: an in-process environment factory, played by run_episode (no endpoint)."""
        self.tok = tok
        self.engine = NativeEngine(copy.deepcopy(model), tok, device="cpu", dtype="float32", runner="fast",
                                   kv_blocks=4096, max_batch=256)
        self.inbox, outbox = queue.Queue(), queue.Queue()
        from conveyor.transport.weights import StagedWeights
        specs = [(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]
        self.thread = threading.Thread(target=engine_loop, daemon=True,
                                       args=(self.engine, self.inbox, outbox, StagedWeights(specs), 0, True, 30.0))
        self.thread.start()
        limits = PoolLimits(concurrency=concurrency, retries=0)
        kwargs = agent if isinstance(agent, dict) else {"agent": agent}
        self.pool = EnvPool(env or (lambda: AgentEnv(**kwargs)), limits, tool_format, name="agent")
        self.limits = EpisodeLimits(max_turns, 400, 64, CONTEXT)
        settings = EndpointSettings(tool_format=tool_format, tools_in_prompt=tools_in_prompt)
        self.endpoint = Endpoint(tok, settings, self.limits, self.pool.count)
        self.params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=5)
        self.runner = EpisodeRunner([ThreadWorker(0, self.inbox, self.thread)], self.pool,
                                    TurnFormat(tok, chat=True), self.limits, n=1, version=lambda: 0,
                                    sampling=lambda seed: SamplingParams(**{**self.params.__dict__, "seed": seed}),
                                    on_failure="drop", attempts=1, timeout_s=60,
                                    agents=None if env else AgentEpisodes(self.endpoint, episode_timeout_s))
        self._stop = threading.Event()
        threading.Thread(target=self._pump, args=(outbox,), daemon=True).start()

    def _pump(self, outbox) -> None:
        while not self._stop.is_set():
            try:
                msg = outbox.get(timeout=0.01)
            except queue.Empty:
                continue
            if isinstance(msg, Done):
                self.runner.answer(msg)

    def play(self, tasks, timeout_s: float = 120.0):
        return self.runner.run_tasks(list(tasks), self.params, timeout_s)

    def close(self) -> None:
        self.runner.close()
        self.inbox.put(Stop())
        self.thread.join(10)
        self._stop.set()


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def build():
    tok = build_tokenizer()
    return tok, taught_model(tok)


async def tool_episode(base_url, api_key, task, seen=None, timeout_s: float = 30.0):
    """An agent written with the openai client: ask, run the tool it calls, ask again."""
    import json

    from openai import AsyncOpenAI
    c = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
    msgs = [{"role": "user", "content": task.prompt}]
    r = await c.chat.completions.create(model="policy", messages=msgs, tools=[CALCULATOR], logprobs=True)
    msg = r.choices[0].message
    msgs.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls or []:
        expression = json.loads(call.function.arguments)["expression"]
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expression))})
    r2 = await c.chat.completions.create(model="policy", messages=msgs, tools=[CALCULATOR], logprobs=True)
    if seen is not None:
        seen += [r, r2]
    return {"reward": float((r2.choices[0].message.content or "").strip() == task.answer), "calls": 2.0}


def check_tool_replies(tok, seen, traj):
    """What every engine must give ``tool_episode``: a calculator call, then "42", recorded with the
    chat template's rendering of the first request as the prompt and the call (+ EOS) as turn 1.
    Returns the first request's messages, the turn records and turn 1's ids."""
    import json
    first, second = seen
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "6*7"}
    assert second.choices[0].message.content == "42" and second.choices[0].finish_reason == "stop"
    user = [{"role": "user", "content": TASK.prompt}]
    assert list(traj.prompt_ids) == ids_of(tok, user)
    recs = traj.turn_records
    assert traj.turns == 2 and recs[0].tool_calls == ("calculator",) and recs[1].tool_calls == ()
    turn1 = list(traj.completion_ids[recs[0].start:recs[0].end])
    assert turn1 == list(tok(CALL, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    return user, recs, turn1


def model_logprobs(model, traj, positions) -> torch.Tensor:
    """The model's own log-probabilities of the recorded sequence at completion ``positions``."""
    ids = torch.tensor([list(traj.prompt_ids + traj.completion_ids)])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(traj.prompt_ids) - 1:][torch.tensor(positions)]
