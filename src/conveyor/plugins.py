"""Resolve user extension points (rewards, workflows, task sources) from strings.

Contract: ``resolve(spec, what, builtins)`` turns ``"name"`` (a key of
``builtins``) or ``"package.module:attr"`` / ``"package.module.attr"`` into the
object it names, and raises ``PluginError`` with one line that names the spec,
what it was for, and how to fix it. This is the one place where conveyor
imports user code by name.
"""
from __future__ import annotations

import importlib
from typing import Any, Mapping


class PluginError(ValueError):
    pass


def resolve(spec: str, what: str, builtins: Mapping[str, str] | None = None) -> Any:
    builtins = builtins or {}
    target = builtins.get(spec, spec)
    if ":" in target:
        mod_name, attr = target.split(":", 1)
    elif "." in target:
        mod_name, attr = target.rsplit(".", 1)
    else:
        names = ", ".join(sorted(builtins)) or "none"
        raise PluginError(f"{what} {spec!r} is not a builtin ({names}) nor a dotted path like pkg.module:fn")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise PluginError(f"{what} {spec!r}: cannot import module {mod_name!r} ({e}); "
                          "check the path and that the package is installed") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what} {spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{what} {spec!r} resolves to a {type(obj).__name__}, not a callable")
    return obj
