"""The environment pool: deadlines, retries, the circuit breaker, tool calls and counters."""
from __future__ import annotations

import asyncio
import time

import pytest

from conveyor.env.api import StepResult, Tool, ToolError, as_step_result, load_env
from conveyor.env.pool import Breaker, EnvFailure, EnvPool, EnvUnusable, PoolLimits
from conveyor.plugins import PluginError
from conveyor.types import Task

TASK = Task("t0", "question", answer="42")


def run(coro):
    return asyncio.run(coro)


class Echo:
    """A plain environment: answers 'you said X', done on 'bye' with reward 1."""
    instances = 0

    def __init__(self):
        Echo.instances += 1

    def reset(self, task):
        return None  # the task's prompt

    def step(self, action):
        if action == "bye":
            return StepResult("", 1.0, True)
        return (f"you said {action}", 0.5, False, {})


class AsyncSlow:
    async def reset(self, task):
        return "start"

    async def step(self, action):
        await asyncio.sleep(10)


class Hangs:
    def reset(self, task):
        return "start"

    def step(self, action):
        time.sleep(5)


class BadReturn:
    def reset(self, task):
        return "start"

    def step(self, action):
        return ["not", "a", "result"]


def add(a: int, b: int) -> str:
    return str(a + b)


def broken(a: int, b: int) -> str:
    raise RuntimeError("tool backend is down")


ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}


class WithTools(Echo):
    def __init__(self, fn=add):
        super().__init__()
        self.tools = [Tool("add", "add two integers", ADD_SCHEMA, fn)]


def limits(**kw):
    base = dict(concurrency=4, reset_timeout_s=2.0, step_timeout_s=0.3, tool_timeout_s=0.3, retries=1,
                backoff_s=0.01, breaker_failures=3, breaker_cooldown_s=60.0)
    base.update(kw)
    return PoolLimits(**base)


def test_reset_step_and_reuse_of_instances():
    Echo.instances = 0
    pool = EnvPool(Echo, limits())

    async def two_episodes():
        out = []
        for _ in range(2):
            async with pool.session() as s:
                out.append(await s.reset(TASK))
                out.append(await s.step("hi"))
                out.append(await s.step("bye"))
        return out
    first, hi, bye, *_ = run(two_episodes())
    assert first == "question"
    assert hi == (StepResult("you said hi", 0.5, False, {}), (), "")
    assert bye[0].done and bye[0].reward == 1.0
    assert Echo.instances == 1  # reset and reused, not rebuilt
    assert pool.counts()["episodes"] == 2
    pool.close()


def test_async_step_past_its_deadline_is_a_counted_timeout_and_the_instance_is_dropped():
    pool = EnvPool(AsyncSlow, limits())

    async def episode():
        async with pool.session() as s:
            await s.reset(TASK)
            await s.step("x")
    t0 = time.monotonic()
    with pytest.raises(EnvFailure, match=r"AsyncSlow.step did not return within 0.3s") as e:
        run(episode())
    assert e.value.kind == "timeout"
    assert time.monotonic() - t0 < 5
    assert pool.counts()["timeout"] == 1
    assert pool._idle == []  # never reused
    pool.close()


def test_a_hung_plain_step_is_abandoned_at_its_deadline():
    pool = EnvPool(Hangs, limits())

    async def episode():
        async with pool.session() as s:
            await s.reset(TASK)
            await s.step("x")
    t0 = time.monotonic()
    with pytest.raises(EnvFailure) as e:
        run(episode())
    assert e.value.kind == "timeout" and time.monotonic() - t0 < 4
    pool.close()


def test_wrong_return_types_are_named():
    pool = EnvPool(BadReturn, limits())

    async def episode():
        async with pool.session() as s:
            await s.reset(TASK)
            await s.step("x")
    with pytest.raises(EnvFailure, match=r"BadReturn.step returned list .*StepResult") as e:
        run(episode())
    assert e.value.kind == "bad_return" and pool.counts()["bad_return"] == 1
    assert as_step_result(("o", 1, True, {}), "w") == StepResult("o", 1.0, True, {})
    with pytest.raises(TypeError):
        as_step_result(("o", "1", True, {}), "w")


def test_reset_is_retried_with_backoff_then_fails_and_the_breaker_quarantines():
    calls = []

    class Flaky:
        def reset(self, task):
            calls.append(time.monotonic())
            raise ConnectionError("backend unreachable")

        def step(self, action):
            return StepResult("", 0.0, True)
    pool = EnvPool(Flaky, limits(breaker_failures=2))

    async def episode():
        async with pool.session() as s:
            await s.reset(TASK)
    for _ in range(2):
        with pytest.raises(EnvFailure, match="ConnectionError: backend unreachable"):
            run(episode())
    assert len(calls) == 4  # one retry each
    assert pool.counts()["crash"] == 4
    assert pool.quarantined() == ["env"]
    # It never worked: not an outage to wait out, a broken environment that stops the run at once.
    with pytest.raises(EnvUnusable) as e:  # at once: a quarantine's wait would end in EnvFailure
        run(episode())
    assert str(e.value) == ("environment env failed 2 times in a row and never worked (last: crash: "
                            "Flaky.reset raised ConnectionError: backend unreachable); fix it or its env.kwargs")
    assert len(calls) == 4  # not tried again
    pool.close()


def test_an_environment_that_worked_and_then_fails_is_waited_for_and_named():
    down = []

    class Outage:
        def reset(self, task):
            if down:
                raise ConnectionError("backend unreachable")
            return "obs"

        def step(self, action):
            return StepResult("", 0.0, True)
    pool = EnvPool(Outage, limits(breaker_failures=2, reset_timeout_s=0.3))

    async def episode():
        async with pool.session() as s:
            await s.reset(TASK)
    run(episode())
    down.append(1)
    for _ in range(2):
        with pytest.raises(EnvFailure, match="ConnectionError"):
            run(episode())
    with pytest.raises(EnvFailure) as e:  # quarantined: held back up to reset_timeout_s, then named
        run(episode())
    assert e.value.kind == "quarantined"
    assert str(e.value) == ("environment env is quarantined after repeated failures (last: crash: Outage.reset "
                            "raised ConnectionError: backend unreachable)")
    pool.close()


def test_tool_calls_run_and_failures_become_error_observations():
    pool = EnvPool(WithTools, limits(), tool_format="hermes")

    async def episode(turns):
        out = []
        async with pool.session() as s:
            await s.reset(TASK)
            for t in turns:
                out.append(await s.step(t))
        return out
    ok, unknown, bad_args, malformed, final = run(episode([
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        '<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": "two", "b": 3}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": ',
        "bye"]))
    assert ok == (StepResult("add: 5"), ("add",), "")
    assert unknown[2] == "unknown_tool" and unknown[0].observation.startswith("error:")
    assert bad_args[2] == "bad_arguments"
    assert malformed[2] == "malformed_call" and not malformed[0].done
    assert final[0].done and final[0].reward == 1.0  # no call: the environment's step answers
    c = pool.counts()
    assert (c["tool_calls"], c["unknown_tool"], c["bad_arguments"], c["malformed_call"]) == (3, 1, 1, 1)
    pool.close()


def test_a_failing_tool_is_quarantined_after_repeated_crashes():
    pool = EnvPool(lambda: WithTools(broken), limits(breaker_failures=2), tool_format="hermes")
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'

    async def episode():
        async with pool.session() as s:
            await s.reset(TASK)
            return [await s.step(call) for _ in range(3)]
    a, b, c = run(episode())
    assert a[2] == b[2] == "crash" and "tool backend is down" in a[0].observation
    assert c[2] == "quarantined" and "quarantined" in c[0].observation
    assert "tool:add" in pool.quarantined()
    pool.close()


def test_tool_errors_the_model_should_read_do_not_trip_the_breaker():
    def strict(a: int, b: int) -> str:
        raise ToolError("b must be positive", kind="bad_arguments")
    pool = EnvPool(lambda: WithTools(strict), limits(breaker_failures=1), tool_format="hermes")
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": -1}}</tool_call>'

    async def episode():
        async with pool.session() as s:
            await s.reset(TASK)
            return [await s.step(call) for _ in range(2)]
    a, b = run(episode())
    assert a[2] == b[2] == "bad_arguments" and "b must be positive" in b[0].observation
    assert pool.quarantined() == []
    pool.close()


def test_concurrency_limit_and_overlap_of_waiting():
    active, peak, full = [0], [0], asyncio.Event()

    class Sleepy:
        async def reset(self, task):
            return "go"

        async def step(self, action):
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            if active[0] == 3:
                full.set()
            await full.wait()  # the first steps overlap until the limit is reached, however slow the loop
            active[0] -= 1
            return StepResult("", 1.0, True)
    pool = EnvPool(Sleepy, limits(concurrency=3, step_timeout_s=30.0))

    async def episode():
        async with pool.session() as s:
            await s.reset(TASK)
            await s.step("x")

    async def many():
        await asyncio.gather(*(episode() for _ in range(9)))
    run(many())
    assert peak[0] == 3  # never more than the limit, and the limit is used
    pool.close()


def test_breaker_trial_after_cooldown(monkeypatch):
    import types

    from conveyor import resilience
    now = [100.0]
    monkeypatch.setattr(resilience, "time", types.SimpleNamespace(monotonic=lambda: now[0]))  # its clock, by hand
    b = Breaker(failures=2, cooldown_s=0.05)
    b.record("x", False)
    assert b.allow("x")
    b.record("x", False)
    assert not b.allow("x")
    now[0] += 0.06
    assert b.allow("x")  # the trial call
    assert not b.allow("x")  # only one
    b.record("x", True)
    assert b.allow("x") and b.open_keys() == []


def test_load_env_by_name_and_dotted_path():
    assert load_env("guess_number").__name__ == "GuessNumber"
    assert load_env("tests.unit.env.test_pool:Echo") is Echo
    with pytest.raises(PluginError, match="env.name 'nope' is not a builtin"):
        load_env("nope")


def test_sessions_are_timeline_rows_whose_spans_nest(tmp_path):
    """Concurrent sessions hold distinct slots; each slot's episode span holds its reset and steps,
    and a slot runs one episode at a time, so Perfetto draws every row without overlaps."""
    from conveyor.observe import timeline
    pool = EnvPool(Echo, PoolLimits(concurrency=2))

    async def episode(words):
        async with pool.session() as s:
            await s.reset(TASK)
            for w in words:
                await s.step(w)
                await asyncio.sleep(0.01)

    async def main():
        await asyncio.gather(episode(["a", "b", "bye"]), episode(["c", "bye"]), episode(["d", "bye"]))

    tl = timeline.Timeline(tmp_path)
    timeline.activate(tl)
    try:
        run(main())
    finally:
        timeline.deactivate(tl)
        tl.close()
        pool.close()
    events = timeline.read_timeline(tmp_path)
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans: dict[str, list] = {}
    for e in events:
        if e["ph"] == "X":
            spans.setdefault(rows[(e["pid"], e["tid"])], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    assert sorted(spans) == ["slot 0", "slot 1"]  # three episodes, at most two at once
    names = sorted(n for row in spans.values() for _, _, n in row)
    assert names == ["episode"] * 3 + ["reset"] * 3 + ["step"] * 7
    for row in spans.values():
        episodes = sorted((a, b) for a, b, n in row if n == "episode")
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(episodes, episodes[1:]))  # one at a time
        for a, b, n in row:
            if n != "episode":
                assert any(ea <= a and b <= eb for ea, eb in episodes), (n, a, b)
