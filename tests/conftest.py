"""How the suite is spread over pytest-xdist's workers (`-n 3` in pyproject.toml), and its time.

A unit of work is a test file, so a module's fixtures are built once; the files whose tests share a
costly session fixture that cannot cross processes are one unit together (the two-node Ray cluster,
`cluster`), since each worker would build its own. The README's default run (`default_run`) is
shared through the disk instead (tests/e2e/conftest.py: the first worker to ask runs it, the others
wait for it). The units go out in the order of the collection after this hook puts the unit that
builds the default run first, the longest units next (``FIRST``), then the other units that hold
whole training runs (`slow`), and the readers of the default run last within their units: the long units start early and the short
ones fill the end, so one worker is not left with a long tail while the others idle. Three workers
on two cores: a worker of this suite keeps a core about two thirds busy (its tests wait on child
processes, servers and deadlines). Without xdist nothing changes but the order.

The suite's time is watched: every run ends with its wall time, the slowest tests and units, and
the tests not marked `slow` that took over ``UNMARKED_S`` seconds. The rule that keeps
`pytest -m "not slow"` a tier a developer runs in minutes: a test that takes over 5 s on an idle
machine is marked `slow` (or made cheaper). The list is printed, never a failure: how long a
test takes depends on the machine and its load, and no verdict here does.
"""
from __future__ import annotations

import os
import sys
import time

import pytest

UNMARKED_S = 5.0   # a test not marked `slow` should stay under this on an idle machine
SLOWEST = 20       # how many tests and units the end-of-run summary lists

# files whose tests share a session fixture -> that fixture: one unit of work per fixture
SHARED = {"cluster": ("tests/e2e/test_ray.py", "tests/e2e/test_ray_bench.py", "tests/e2e/test_ray_channels.py",
                      "tests/e2e/test_ray_rewards.py")}
_UNIT = {path: fixture for fixture, paths in SHARED.items() for path in paths}
# units that go out first, in this order: the one that builds the shared default run (its other
# readers wait for it), then the longest (the Ray cluster's tests, the agent's learning run)
FIRST = ("tests/e2e/test_learning.py", "cluster", "tests/e2e/test_agent_learning.py")


# units that run at the normal CPU priority; the others run niced (``NICE``). The Ray cluster's
# tests hand every message between several processes (driver, actors, raylets), so on a loaded
# machine they wait for CPU at each hop: beside two busy workers the W1 Ray row took 374 s against
# 42 s alone. They are the suite's longest unit; priority keeps them near their idle time and the
# other workers fill the rest of the CPU. The default run's unit goes first and its readers wait.
PRIORITY = ("tests/e2e/test_learning.py", "cluster")
NICE = 10


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return _UNIT.get(path, path)


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker runs torch (and the processes its tests start) on one thread: three workers
    share two cores, and a pool of threads per worker spins against the others (a CPU-bound run
    beside two others took 75 s on one thread each against 96 s on torch's default two)."""
    if getattr(config, "workerinput", None) is not None:
        os.environ["OMP_NUM_THREADS"] = "1"
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """An xdist worker lowers its priority to ``NICE`` (once: it cannot raise it back) at its first
    test outside ``PRIORITY``; processes it starts inherit it. xdist gives each worker one unit
    first, in ``FIRST``'s order, so the priority units start on workers not yet niced."""
    if getattr(item.config, "workerinput", None) is not None and unit_of(item.nodeid) not in PRIORITY:
        current = os.nice(0)
        if current < NICE:
            os.nice(NICE - current)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        unit = unit_of(item.nodeid)
        for fixture in SHARED:
            if fixture in item.fixturenames and unit != fixture:  # would build it on a second worker
                raise pytest.UsageError(f"{item.nodeid} uses the session fixture {fixture!r}: add its file to "
                                        f"SHARED[{fixture!r}] in tests/conftest.py")
        units.setdefault(unit, []).append(item)
    def order(unit: list[pytest.Item]) -> tuple[int, bool]:
        name = unit_of(unit[0].nodeid)
        return FIRST.index(name) if name in FIRST else len(FIRST), not any(i.get_closest_marker("slow") for i in unit)
    for unit in units.values():  # a unit's readers of the shared default run last: it is built meanwhile
        unit.sort(key=lambda i: "default_run" in i.fixturenames)
    items[:] = [i for u in sorted(units.values(), key=order) for i in u]


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with `unit_of` as the scope, in the collection's order
    (`--no-loadscope-reorder`)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)
    return ByUnit(config, log)


_START = time.monotonic()
_TOOK: dict[str, float] = {}      # nodeid -> setup + call + teardown seconds
_SLOW: dict[str, bool] = {}       # nodeid -> marked slow


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _TOOK[report.nodeid] = _TOOK.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or report.when == "setup":
        _SLOW.setdefault(report.nodeid, "slow" in report.keywords)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """The suite's time at the end of every run (on xdist's controller the workers' reports)."""
    if not _TOOK or getattr(config, "workerinput", None) is not None:
        return
    wall = time.monotonic() - _START
    workers = getattr(config.option, "numprocesses", None) or 0
    units: dict[str, float] = {}
    for nodeid, took in _TOOK.items():
        units[unit_of(nodeid)] = units.get(unit_of(nodeid), 0.0) + took
    w = terminalreporter.write_line
    w("")
    quick = [t for n, t in _TOOK.items() if not _SLOW.get(n)]
    w(f"suite: {len(_TOOK)} tests, wall {wall:.0f} s on {workers or 1} worker(s), "
      f"{sum(_TOOK.values()):.0f} s of test time; of it the tests not marked slow: {len(quick)}, "
      f"{sum(quick):.0f} s")
    w(f"slowest {SLOWEST} tests (setup + call + teardown):")
    for nodeid, took in sorted(_TOOK.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        w(f"  {took:7.1f} s  {'slow' if _SLOW.get(nodeid) else '    '}  {nodeid}")
    w(f"slowest {min(SLOWEST, 10)} units of work (a file, or the files sharing a session fixture):")
    for unit, took in sorted(units.items(), key=lambda kv: -kv[1])[:min(SLOWEST, 10)]:
        w(f"  {took:7.1f} s  {unit}")
    over = [(n, t) for n, t in _TOOK.items() if not _SLOW.get(n) and t > UNMARKED_S]
    if over:
        w(f"tests not marked slow that took over {UNMARKED_S:.0f} s here (mark them `slow` or make them "
          "cheaper if they do so on an idle machine; tests/conftest.py):")
        for nodeid, took in sorted(over, key=lambda kv: -kv[1]):
            w(f"  {took:7.1f} s  {nodeid}")
