"""How the suite is spread over pytest-xdist's two workers (`-n 2` in pyproject.toml).

A unit of work is a test file, so a module's fixtures are built once; the files whose tests share a
costly session fixture are one unit together (the two-node Ray cluster, `cluster`; the README's
default run, `default_run`, whose warm start the LoRA test reuses), since each worker builds its
own. The units go out in the order of the collection after this hook puts the units that hold
whole training runs (`slow`) first: the long units start early and the short ones fill the end,
so one worker is not left with a long tail while the other idles. Without xdist nothing changes but
the order.
"""
from __future__ import annotations

import pytest

# files whose tests share a session fixture -> that fixture: one unit of work per fixture
SHARED = {"cluster": ("tests/e2e/test_ray.py", "tests/e2e/test_ray_bench.py", "tests/e2e/test_ray_channels.py",
                      "tests/e2e/test_ray_rewards.py"),
          "default_run": ("tests/e2e/test_learning.py", "tests/e2e/test_lora_learning.py")}
_UNIT = {path: fixture for fixture, paths in SHARED.items() for path in paths}


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return _UNIT.get(path, path)


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
    def slow(unit: list[pytest.Item]) -> bool:
        return any(i.get_closest_marker("slow") for i in unit)
    items[:] = [i for u in sorted(units.values(), key=lambda u: not slow(u)) for i in u]


@pytest.hookimpl(optionalhook=True)  # an xdist hook
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with `unit_of` as the scope, in the collection's order
    (`--no-loadscope-reorder`)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)
    return ByUnit(config, log)
