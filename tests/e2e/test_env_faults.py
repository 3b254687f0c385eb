"""A multi-turn RL run survives environments that crash, hang and return the wrong type (counted,
groups whole, slots refilled), stops with the environment named when nothing works, and the
Python tool's escape attempts become error observations while the episode goes on."""
from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from conveyor.api import load_config, train
from conveyor.env.api import StepResult, Tool
from conveyor.env.pool import EnvPool, EnvUnusable, PoolLimits
from conveyor.env.tool_env import ToolEnv
from conveyor.runtime.errors import RoleError
from conveyor.transport.buffer import BufferClosed
from conveyor.types import Task


def _draw(task_id: str, turn: int) -> float:
    h = hashlib.sha256(f"{task_id}/{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") / 2**32


class Flaky:
    """Two turns; a step crashes, hangs or returns garbage on a seeded share of (task, turn)."""

    def reset(self, task):
        self.task, self.turn = task, 0
        return task.prompt

    def step(self, action):
        self.turn += 1
        u = _draw(self.task.id + action, self.turn)
        if u < 0.08:
            raise RuntimeError("flaky backend")
        if u < 0.12:
            time.sleep(3)  # past env.step_timeout_s
        if u < 0.16:
            return "not a StepResult"
        if self.turn >= 2:
            return StepResult("", float(len(action) % 3 == 0), True)
        return StepResult("ok", 0.0, False)


class Broken:
    def reset(self, task):
        raise ConnectionError("service is down")

    def step(self, action):
        return StepResult("", 0.0, True)


class BadTool:
    """A tool whose schema names a type JSON does not have."""
    tools = [Tool("calc", "adds", {"type": "object", "properties": {"x": {"type": "int"}}}, lambda x: str(x))]

    def reset(self, task):
        return task.prompt

    def step(self, action):
        return StepResult("", 0.0, True)


def _cfg(tmp_path, env: str, **extra):
    overrides = [f"env.name={env}", "env.max_turns=2", "env.step_timeout_s=0.5", "env.retries=0",
                 "data.source=synthetic:reverse", "data.eval_size=8", "sft.steps=0", "loop.steps=3",
                 "loop.batch_size=4", "rollout.n=4", "rollout.max_new_tokens=4", "loop.eval_every=0",
                 "loop.eval_sampled=false", "observe.progress=false", "observe.tensorboard=false",
                 "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64",
                 f"output_dir={tmp_path / 'run'}"] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, overrides)


@pytest.mark.slow  # over 5 s on a 2-core CPU: `pytest -m "not slow"` leaves it out
@pytest.mark.parametrize("policy", ["retry", "drop"])
def test_faulty_environment_is_counted_and_survived(tmp_path, policy):
    # (a breaker that never opens: this is about counting and surviving; the breaker has its own tests)
    cfg = _cfg(tmp_path, "tests.e2e.test_env_faults:Flaky", **{"env.on_failure": policy,
                                                                "env.breaker_failures": 1000})
    summary = train(cfg, tmp_path / "run")
    last = summary.raw["final_metrics"]
    assert summary.steps == 3
    failures = sum(last.get(f"env_{k}", 0) for k in ("crash", "timeout", "bad_return"))
    assert failures > 0, last
    assert last["env_episodes_failed"] > 0
    if policy == "drop":
        assert last["groups_dropped"] > 0


def test_an_environment_that_never_works_stops_the_run_naming_it(tmp_path):
    cfg = _cfg(tmp_path, "tests.e2e.test_env_faults:Broken", **{"env.max_failed_groups": 4,
                                                                 "env.breaker_failures": 100})
    t0 = time.monotonic()
    with pytest.raises((RoleError, BufferClosed), match=r"environment pool: 4 groups in a row failed; last error: crash: "
                                        r"Broken.reset raised ConnectionError: service is down"):
        train(cfg, tmp_path / "run")
    assert time.monotonic() - t0 < 120


def test_escape_attempts_through_the_python_tool_become_observations():
    pool = EnvPool(lambda: ToolEnv(tools=("python",), sandbox={"wall_s": 3, "cpu_s": 2}),
                   PoolLimits(tool_timeout_s=20, step_timeout_s=20), tool_format="plain")
    attempts = {
        "network": "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)",
        "shadow": "print(open('/etc/shadow').read())",
        "fork bomb": "import os\nwhile True: os.fork()",
        "loop": "while True: pass",
        "flood": "print('x' * 100_000_000)",
        "memory": "b = bytearray(10 * 2**30)",
    }

    async def episode():
        out = {}
        async with pool.session() as s:
            await s.reset(Task("t", "q", answer="7"))
            for name, code in attempts.items():
                out[name] = await s.step(f"python(code={code!r})")
            out["answer"] = await s.step("7")
        return out
    out = asyncio.run(episode())
    for name in attempts:
        result, tools, failure = out[name]
        assert tools == ("python",) and not result.done, name
        assert failure in ("sandbox_violation", "timeout") or "Error" in result.observation, (name, result)
    assert out["answer"][0].done and out["answer"][0].reward == 1.0  # the episode went on
    pool.close()


def test_bad_env_kwargs_are_refused_before_the_run_in_one_line(tmp_path, capsys):
    from conveyor.cli import main
    rc = main(["train", f"--output-dir={tmp_path / 'run'}", "env.name=tools", "env.kwargs.tools=[abacus]",
               "data.source=synthetic:multiply", "sft.steps=0", "loop.steps=1", "observe.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert any("env.name='tools' with env.kwargs={'tools': ['abacus']}: building it raised ValueError: "
               "env.kwargs.tools: unknown tool(s) ['abacus']" in line for line in err), err
    assert not any("Traceback" in line for line in err)


def test_an_environment_broken_from_the_start_stops_the_run_at_once_naming_its_error(tmp_path):
    # The default breaker: five failures in a row before any reset worked is a broken environment,
    # not an outage to wait out (before, the run waited out launch.timeout_s and named nothing).
    cfg = _cfg(tmp_path, "tests.e2e.test_env_faults:Broken")
    with pytest.raises(EnvUnusable, match=r"environment tests.e2e.test_env_faults:Broken failed 5 times in a row "
                                          r"and never worked \(last: crash: Broken.reset raised ConnectionError: "
                                          r"service is down\); fix it or its env.kwargs"):
        train(cfg, tmp_path / "run")


def test_a_tool_with_a_broken_schema_is_refused_before_the_run_in_one_line(tmp_path, capsys):
    from conveyor.cli import main
    rc = main(["train", f"--output-dir={tmp_path / 'run'}", "env.name=tests.e2e.test_env_faults:BadTool",
               "sft.steps=0", "loop.steps=1", "observe.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "conveyor: error: env.name='tests.e2e.test_env_faults:BadTool': tool calc: " \
        "parameters.properties.x.type 'int' is not a JSON type" in "\n".join(err), err
    assert not any("Traceback" in line for line in err)
