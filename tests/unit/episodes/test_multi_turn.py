"""Multi-turn episodes with a real tiny NativeEngine served by engine_loop in a thread: tokens in,
tokens out (the history is never re-tokenised), environment tokens masked, every policy token's
logprob equal to the model's own at that place of the whole sequence, budgets, truncated
observations, the failure policy, and turn-level advantages against a hand computation."""
from __future__ import annotations

import copy
import queue
import random
import threading
import time

import pytest
import torch

from conveyor import algo
from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.env.api import StepResult
from conveyor.env.pool import EnvPool, PoolLimits
from conveyor.episodes.multi_turn import CUT_MARKER, EpisodeLimits, TurnFormat
from conveyor.episodes.runner import EpisodeRunner
from conveyor.launch.roles import ThreadWorker
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.serve import engine_loop
from conveyor.transport.messages import Done, Stop
from conveyor.transport.weights import StagedWeights
from conveyor.types import Task

TEMPLATE = "\n[{observation}]\n"


class Counter:
    """Answers each turn with its number; done after `turns` turns (reward 1 at the end)."""

    def __init__(self, turns=3, obs="seen"):
        self.turns, self.obs, self.n = turns, obs, 0

    def reset(self, task):
        self.n = 0
        return task.prompt

    def step(self, action):
        self.n += 1
        if self.n >= self.turns:
            return StepResult("", 1.0, True)
        return StepResult(f"{self.obs}{self.n}", 0.25, False)


class Crashy(Counter):
    def step(self, action):
        raise RuntimeError("environment bug")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       seed=0).eval()


@pytest.fixture
def served(model, tok):
    """An engine worker thread and a pump that hands turn answers to the runner."""
    made = []

    def start(env_factory, *, n=2, max_turns=3, max_tokens=200, max_obs=64, on_failure="retry", params=None):
        engine = NativeEngine(copy.deepcopy(model), tok, device="cpu", dtype="float32", runner="fast",
                              kv_blocks=256, max_batch=16)
        inbox, outbox = queue.Queue(), queue.Queue()
        specs = [(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]
        t = threading.Thread(target=engine_loop, args=(engine, inbox, outbox, StagedWeights(specs), 0, True, 30.0),
                             daemon=True)
        t.start()
        fmt = TurnFormat(tok, chat=False, template=TEMPLATE)
        pool = EnvPool(env_factory, PoolLimits(concurrency=8, step_timeout_s=5, retries=0))
        sp = params or SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
        runner = EpisodeRunner([ThreadWorker(0, inbox, t)], pool, fmt, EpisodeLimits(max_turns, max_tokens, max_obs, 256),
                               sampling=lambda seed: SamplingParams(**{**sp.__dict__, "seed": seed, "n": 1}), n=n,
                               version=lambda: 0, on_failure=on_failure, attempts=2, timeout_s=30)
        stop = threading.Event()

        def pump():
            while not stop.is_set():
                try:
                    msg = outbox.get(timeout=0.01)
                except queue.Empty:
                    continue
                if isinstance(msg, Done):
                    runner.answer(msg)
        threading.Thread(target=pump, daemon=True).start()
        made.append((inbox, t, stop, runner))
        return runner, engine, fmt
    yield start
    for inbox, t, stop, runner in made:
        runner.close()
        inbox.put(Stop())
        t.join(10)
        stop.set()


def wait_groups(runner, k, timeout=60):
    import time
    out, deadline = [], time.monotonic() + timeout
    while len(out) < k and time.monotonic() < deadline:
        out += runner.finished()
        time.sleep(0.01)
    assert len(out) == k, out
    return out


def test_episode_tokens_masks_and_logprobs(served, model, tok):
    runner, engine, fmt = served(lambda: Counter(turns=3))
    task = Task("t", "count:")
    runner.start_group(0, task, seed=11)
    (out,) = wait_groups(runner, 1)
    assert out.group is not None and len(out.group.trajectories) == 2
    for traj in out.group.trajectories:
        assert traj.prompt_ids == tuple(tok("count:", add_special_tokens=False)["input_ids"])
        recs = traj.turn_records
        assert traj.turns == len(recs) == 3 and traj.finish_reason == "stop"
        assert [r.reward for r in recs] == [0.25, 0.25, 1.0] and traj.env_return == 1.5
        # Between turns: exactly the observation's own tokens, masked, logprob 0, version -1.
        for k in range(2):
            gap = traj.completion_ids[recs[k].end:recs[k + 1].start]
            assert list(gap) == tok(TEMPLATE.format(observation=f"seen{k + 1}"), add_special_tokens=False)["input_ids"]
            sl = slice(recs[k].end, recs[k + 1].start)
            assert set(traj.loss_mask[sl]) == {0} and set(traj.logprobs[sl]) == {0.0} and set(traj.versions[sl]) == {-1}
        for r in recs:
            assert set(traj.loss_mask[r.start:r.end]) == {1} and set(traj.versions[r.start:r.end]) == {0}
        # The trainer's view: the model's log-probabilities over the whole sequence at every policy
        # token equal the engine's behaviour logprobs (float32 on both sides: a few ulps of the
        # logits' scale, |logit| < 10 for this model).
        ids = torch.tensor([list(traj.prompt_ids + traj.completion_ids)])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        head = len(traj.prompt_ids)
        own = torch.tensor(traj.loss_mask, dtype=torch.bool)
        got = lp[head - 1:][own]
        want = torch.tensor(traj.logprobs)[own]
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def test_turns_and_token_budgets_and_truncated_observations(served, tok):
    runner, _, fmt = served(lambda: Counter(turns=99, obs="x" * 100), max_turns=4, max_obs=12, n=1)
    runner.start_group(0, Task("t", "go:"), seed=3)
    (out,) = wait_groups(runner, 1)
    traj = out.group.trajectories[0]
    assert traj.turns == 4 and traj.finish_reason == "length"
    gap = traj.completion_ids[traj.turn_records[0].end:traj.turn_records[1].start]
    assert len(gap) == 12 and tok.decode(list(gap)).endswith(CUT_MARKER)
    assert runner.pool.counts()["truncated_observation"] == 3

    big, _, _ = served(lambda: Counter(turns=2, obs="y" * 5_000_000), max_obs=20, n=1)  # a 5 MB observation
    big.start_group(0, Task("t", "go:"), seed=3)
    (out_big,) = wait_groups(big, 1)
    tb = out_big.group.trajectories[0]
    gap = tb.completion_ids[tb.turn_records[0].end:tb.turn_records[1].start]
    assert len(gap) == 20 and tok.decode(list(gap)).endswith(CUT_MARKER)
    assert big.pool.counts()["truncated_observation"] == 1

    runner2, _, _ = served(lambda: Counter(turns=99), max_turns=10, max_tokens=15, n=1)
    runner2.start_group(0, Task("t", "go:"), seed=3)
    (out2,) = wait_groups(runner2, 1)
    t2 = out2.group.trajectories[0]
    assert len(t2.completion_ids) <= 15 and t2.finish_reason == "length"


def test_failed_episodes_fail_the_group_whole_after_retries(served):
    runner, _, _ = served(Crashy, n=3, on_failure="retry")
    runner.start_group(5, Task("t", "go:"), seed=1)
    (out,) = wait_groups(runner, 1)
    assert out.group is None and out.index == 5 and "environment bug" in out.error and not out.fatal
    assert runner.pool.counts()["episodes_failed"] == 6  # 3 episodes x 2 attempts
    assert runner.pool.counts()["crash"] == 6


def test_demonstrations_do_not_depend_on_the_order_environments_answer_in(served):
    """The multi-turn warm start's teacher draws from a stream of its own per episode: the same
    demonstrations whichever episode's environment answers first."""
    order: list[str] = []
    plan: list[tuple[str, int]] = []  # (task id, turn): the order the environments answer in
    answered = threading.Condition()

    class Slow(Counter):
        def reset(self, task):
            self.task_id = task.id
            return super().reset(task)

        def step(self, action):
            with answered:  # once every step before this one in the plan has answered
                assert answered.wait_for(lambda: plan[len(order)] == (self.task_id, self.n), timeout=4.0)
                order.append(self.task_id)
                answered.notify_all()
            return super().step(action)

    def teacher(task, transcript, rng):
        return str(rng.randrange(10**6))

    runner, _, _ = served(lambda: Slow(turns=3), n=1)
    tasks = [Task(id=f"t{i}", prompt=f"p{i}") for i in range(6)]
    played = []
    for slow_first in (True, False):  # the first tasks' environments slowest, then the last ones'
        ranked = tasks[::-1] if slow_first else tasks
        plan[:] = [(t.id, turn) for turn in range(3) for t in ranked]
        order.clear()
        out = runner.demonstrate(tasks, teacher, random.Random(0), timeout_s=30)
        played.append(([t.task.id for t in out], [t.completion_ids for t in out], list(order)))
    (ids1, done1, order1), (ids2, done2, order2) = played
    assert order1 != order2  # the turns were taken in another order
    assert ids1 == ids2 == [t.id for t in tasks] and done1 == done2


def test_turn_advantages_by_hand():
    # Two episodes: rewards per turn [0, 0, 1] and [0.5] (one turn); gamma 0.5.
    r = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    a = algo.turn_advantages(r, m, gamma=0.5)
    G = [0.25, 0.5, 1.0, 0.5]  # returns of the four real turns
    mean = sum(G) / 4
    std = (sum((g - mean) ** 2 for g in G) / 4) ** 0.5
    want = torch.tensor([[(G[0] - mean) / std, (G[1] - mean) / std, (G[2] - mean) / std],
                         [(G[3] - mean) / std, 0.0, 0.0]])
    assert torch.allclose(a, want, atol=1e-5)
    centred = algo.turn_advantages(r, m, gamma=0.5, std_normalize=False)
    assert torch.allclose(centred[0], torch.tensor([G[0] - mean, G[1] - mean, G[2] - mean]))


def test_chat_format_closes_the_turn_and_opens_the_next(tok):
    fmt = TurnFormat(tok, chat=True, role="tool")
    # The tiny template ends an assistant message with a newline; the model's turn ended at EOS,
    # so the observation starts by closing it, then the tool message, then the next assistant turn.
    assert tok.decode(fmt.observation_ids("42", ended_with_eos=True)) == "\n<|tool|>42\n<|assistant|>"
    first = fmt.first_prompt("what is 6*7?", ())
    assert tok.decode(first) == "<|user|>what is 6*7?\n<|assistant|>"
    plain = TurnFormat(tok, chat=False, template=" [{observation}]")
    assert tok.decode(plain.observation_ids("x", ended_with_eos=True)) == " [x]"
