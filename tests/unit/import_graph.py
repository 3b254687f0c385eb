"""The package import graph of src/conveyor, read with ``ast`` (nothing is imported).

Every import counts: at module level, inside a function or class, under ``try``; an import under
``if TYPE_CHECKING:`` is collected too and marked ``type_checking``, and a string that is a dotted
path to an object (``"conveyor.reward.verifiers:math_reward"``, what ``plugins.resolve`` imports at
run time) counts as an import of its module, marked ``dotted``. Relative imports are resolved
against the importing module. Each import is mapped to its floor node: the first name under
``conveyor`` (a subpackage such as ``rollout``, or a single-file module such as ``loop`` or
``types``); ``conveyor/__init__.py`` is the node ``__init__``.

Run as a script it prints the graph (edges with how many imports make them) and its strongly
connected components::

    python tests/unit/import_graph.py            # every import
    python tests/unit/import_graph.py --edges    # and each import behind an edge

tests/unit/test_floors.py checks the graph against the floors.
"""
from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "conveyor"


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is, and what node it lands on."""
    file: str               # relative to src/, e.g. "conveyor/loop.py"
    line: int
    module: str             # the imported module, absolute ("conveyor.launch.api", "ray")
    src: str                # node of the importing file
    dst: str | None         # node of the imported module (None: outside conveyor)
    function_level: bool    # inside a def / class body
    type_checking: bool     # under ``if TYPE_CHECKING:``
    dotted: bool = False    # a "module:object" string, imported at run time

    def where(self) -> str:
        kind = " (TYPE_CHECKING)" if self.type_checking else (" (in a function)" if self.function_level else "")
        verb = "names the dotted path to" if self.dotted else "imports"
        return f"src/{self.file}:{self.line} {verb} {self.module}{kind}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


DOTTED = re.compile(r"conveyor(?:\.\w+)+:\w+")


def node_of(module: str) -> str | None:
    """The floor node of an absolute module name, None outside conveyor."""
    parts = module.split(".")
    if parts[0] != "conveyor":
        return None
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _submodule_exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (SRC / rel).is_dir() or (SRC / rel).with_suffix(".py").is_file()


def imports_of(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    src_node = node_of(me)
    rel_file = str(path.relative_to(SRC))
    found: list[Import] = []

    def add(module: str, line: int, in_fn: bool, tc: bool, dotted: bool = False) -> None:
        imp = Import(rel_file, line, module, src_node, node_of(module), in_fn, tc, dotted)
        if imp not in found:  # ``from m import a, b``: one import of m
            found.append(imp)

    def visit(node: ast.AST, in_fn: bool, tc: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, in_fn, tc)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                base_mod = ".".join(base + ([node.module] if node.module else []))
            else:
                base_mod = node.module or ""
            for alias in node.names:
                sub = f"{base_mod}.{alias.name}"
                # ``from conveyor import loop`` imports the module conveyor.loop
                add(sub if _submodule_exists(sub) else base_mod, node.lineno, in_fn, tc)
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.fullmatch(node.value):
            add(node.value.split(":", 1)[0], node.lineno, in_fn, tc, dotted=True)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_fn, True)
            for child in node.orelse:
                visit(child, in_fn, tc)
            return
        inner = in_fn or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, tc)

    visit(tree, False, False)
    return found


def all_imports(pkg: Path = PKG) -> list[Import]:
    out: list[Import] = []
    for path in sorted(pkg.rglob("*.py")):
        out.extend(imports_of(path))
    return out


def nodes(pkg: Path = PKG) -> set[str]:
    """Every node of the package: its subpackages and top-level modules."""
    found = {"__init__"}
    for p in pkg.iterdir():
        if p.is_dir() and (p / "__init__.py").is_file():
            found.add(p.name)
        elif p.suffix == ".py" and p.stem != "__init__":
            found.add(p.stem)
    return found


def graph(imports: list[Import], *, type_checking: bool = False) -> dict[str, dict[str, list[Import]]]:
    """node -> node -> the imports behind that edge (self edges dropped)."""
    g: dict[str, dict[str, list[Import]]] = {}
    for imp in imports:
        if imp.dst is None or imp.dst == imp.src or (imp.type_checking and not type_checking):
            continue
        g.setdefault(imp.src, {}).setdefault(imp.dst, []).append(imp)
    return g


def sccs(g: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    all_nodes = set(g) | {d for e in g.values() for d in e}

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(all_nodes):
        if v not in index:
            strong(v)
    return sorted(out)


def report(imports: list[Import], *, show_edges: bool = False) -> str:
    lines: list[str] = []
    for label, subset in (("module level", [i for i in imports if not i.function_level and not i.type_checking]),
                          ("every import (module and function level)", [i for i in imports if not i.type_checking])):
        g = graph(subset)
        lines.append(f"== {label}")
        for src in sorted(g):
            lines.append(f"{src:>12} -> " + ", ".join(f"{d}({len(v)})" for d, v in sorted(g[src].items())))
        comps = sccs(g)
        lines.append("cycles (SCCs): " + ("; ".join("{" + ", ".join(c) + "}" for c in comps) if comps else "none"))
        lines.append("")
    tc = [i for i in imports if i.type_checking and i.dst is not None and i.dst != i.src]
    lines.append("== TYPE_CHECKING imports")
    lines.extend("  " + i.where() for i in tc) if tc else lines.append("  none")
    if show_edges:
        lines.append("")
        lines.append("== the imports behind each edge")
        g = graph(imports, type_checking=True)
        for src in sorted(g):
            for dst in sorted(g[src]):
                lines.append(f"{src} -> {dst}")
                lines.extend("    " + i.where() for i in g[src][dst])
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(all_imports(), show_edges="--edges" in sys.argv))
