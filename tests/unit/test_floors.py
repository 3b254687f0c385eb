"""The package import graph is a DAG of floors (docs/architecture.md, "Floors").

Every import of src/conveyor counts (module level, inside functions, under ``TYPE_CHECKING``, and
``"module:object"`` strings that the plugin loader imports at run time), read with ``ast`` by
tests/unit/import_graph.py; nothing is imported. Each failure names the import: file, line,
imported module.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("floors_import_graph", Path(__file__).with_name("import_graph.py"))
G = sys.modules.setdefault("floors_import_graph", importlib.util.module_from_spec(_spec))
if not hasattr(G, "all_imports"):
    _spec.loader.exec_module(G)

# The floors, bottom first. Each floor is a list of groups. An import may go to any lower floor, or
# inside its own group (where the packages form a DAG); never up, and never across two groups of one
# floor: the roles never import each other, and the launchers and the controller neither. Episodes
# sit above the roles (they drive engines and environments) and below the controller, which runs
# them. Every package and top-level module of src/conveyor is in exactly one group: a new one must be
# placed here.
FLOORS: list[tuple[str, list[set[str]]]] = [
    ("base", [{"runtime", "types", "config", "staleness", "plugins", "net", "resilience", "algo"}]),
    ("shared", [{"data", "observe", "transport", "sandbox", "sandbox_limits", "routing", "verifiers"}]),
    ("roles", [{"trainer"}, {"rollout"}, {"reward"}, {"env"}]),
    ("episodes", [{"episodes"}]),
    ("control", [{"controller", "loop"}, {"launch"}]),
    ("top", [{"run", "api", "cli", "__init__"}]),
]
ROLES = "roles"
TOP = "top"
# What episodes/ may import of the roles: their api modules, and the environment pool with the
# tool-call formats that it and the endpoint share; never a built-in environment, an engine's
# implementation or a reward.
EPISODES_USE = {"conveyor.rollout.api", "conveyor.env.api", "conveyor.env.pool", "conveyor.env.chat",
                "conveyor.env.parsers"}

# Known violations, each with its reason: (importing file relative to src/, imported module) -> why.
# Empty: the graph has none. An entry that no longer matches an import fails the test too.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _place() -> dict[str, tuple[int, int]]:
    place: dict[str, tuple[int, int]] = {}
    for f, (_, groups) in enumerate(FLOORS):
        for g, group in enumerate(groups):
            for node in group:
                assert node not in place, f"{node} is placed twice in FLOORS"
                place[node] = (f, g)
    return place


PLACE = _place()
FLOOR_OF = {name: f for f, (name, _) in enumerate(FLOORS)}
ALL = G.all_imports()
IMPORTS = [i for i in ALL if i.dst is not None and i.dst != i.src]


def _unexcused(bad: list) -> list:
    return [i for i in bad if (i.file, i.module) not in EXCEPTIONS]


def _check(what: str, bad: list) -> None:
    if bad:
        raise AssertionError(f"{what}:\n" + "\n".join("  " + i.where() for i in bad))


def test_every_package_has_a_floor():
    """A package or top-level module missing from FLOORS fails here, by name; so does an entry
    that names nothing."""
    nodes = G.nodes()
    unknown = sorted(nodes - set(PLACE))
    if unknown:
        raise AssertionError(f"no floor for {', '.join('conveyor.' + n for n in unknown)}: place it in FLOORS "
                             "(tests/unit/test_floors.py) and in docs/architecture.md")
    stale = sorted(set(PLACE) - nodes)
    if stale:
        raise AssertionError(f"FLOORS names {', '.join(stale)}, which src/conveyor does not have")


def test_no_cycle_among_packages():
    g = G.graph(_unexcused(IMPORTS), type_checking=True)
    cycles = G.sccs(g)
    if cycles:
        lines = []
        for comp in cycles:
            lines.append("cycle among {" + ", ".join(comp) + "}; its edges, each with its first import:")
            members = set(comp)
            for src in comp:
                for dst, imps in sorted(g.get(src, {}).items()):
                    if dst in members:
                        more = f" (and {len(imps) - 1} more)" if len(imps) > 1 else ""
                        lines.append(f"  {src} -> {dst}: {imps[0].where()}{more}")
        raise AssertionError("\n".join(lines))


def test_imports_go_down_the_floors():
    """No import goes up a floor, or across two groups of one floor."""
    up, across = [], []
    for imp in _unexcused(IMPORTS):
        if imp.src not in PLACE or imp.dst not in PLACE:
            continue  # test_every_package_has_a_floor names it
        (fs, gs), (fd, gd) = PLACE[imp.src], PLACE[imp.dst]
        if fd > fs:
            up.append(imp)
        elif fd == fs and gd != gs and FLOORS[fs][0] != ROLES:
            across.append(imp)  # the roles' own test names theirs
    problems = [f"{what}:\n" + "\n".join("  " + i.where() for i in bad) for what, bad in (
        ("imports of a higher floor (FLOORS in tests/unit/test_floors.py)", up),
        ("imports across two groups of one floor (FLOORS in tests/unit/test_floors.py)", across)) if bad]
    if problems:
        raise AssertionError("\n".join(problems))


def test_roles_never_import_each_other():
    roles = FLOOR_OF[ROLES]
    bad = [i for i in _unexcused(IMPORTS) if PLACE.get(i.src, (None,))[0] == roles
           and PLACE.get(i.dst, (None,))[0] == roles]
    _check("a role imports another role (take a protocol of the floors below instead)", bad)


def test_episodes_import_only_the_roles_public_modules():
    roles = FLOOR_OF[ROLES]
    bad = [i for i in _unexcused(IMPORTS) if i.src == "episodes" and PLACE.get(i.dst, (None,))[0] == roles
           and i.module not in EPISODES_USE]
    _check("episodes/ imports a role's module outside EPISODES_USE (tests/unit/test_floors.py): take what it "
           "needs through the role's api.py", bad)


def test_launch_is_imported_only_from_the_top():
    top = FLOOR_OF[TOP]
    bad = [i for i in _unexcused(IMPORTS) if i.dst == "launch" and i.src != "launch"
           and PLACE.get(i.src, (None,))[0] != top]
    _check("conveyor.launch imported below the top floor (run/, api.py, cli.py, __init__.py)", bad)


def test_ray_is_imported_only_under_launch():
    bad = [i for i in ALL if (i.module == "ray" or i.module.startswith("ray."))
           and not i.file.startswith("conveyor/launch/") and (i.file, i.module) not in EXCEPTIONS]
    _check("Ray imported outside conveyor/launch/", bad)


def test_exceptions_are_still_needed():
    every = {(i.file, i.module) for i in ALL}
    gone = sorted(k for k in EXCEPTIONS if k not in every)
    if gone:
        raise AssertionError(f"EXCEPTIONS lists imports that no longer exist: {gone}")
