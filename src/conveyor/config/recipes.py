"""Recipes: files of sections read with their ``base:``, dotted overrides, validation with
one-line errors, and what a config differs in from its base (``conveyor config``)."""
from __future__ import annotations

import json
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError


from conveyor.config.base import ConfigError, did_you_mean
from conveyor.config.sections import RunConfig


DEFAULT_RECIPE = Path(__file__).parent.parent / "recipes" / "default.yaml"
PRETRAINED_RECIPE = Path(__file__).parent.parent / "recipes" / "pretrained.yaml"
# Names `base:` accepts besides a path: the built-in recipes, or nothing (pydantic defaults).
BUILTIN_BASES = {"default": DEFAULT_RECIPE, "pretrained": PRETRAINED_RECIPE}
NO_BASE = ("none", "null", None)


class Replace(dict):
    """A recipe's mapping tagged ``!replace``: it replaces the mapping its base has under that key
    instead of being merged into it (``data.options: !replace {size: 3}``)."""


class _RecipeLoader(yaml.SafeLoader):
    pass


def _replace(loader: yaml.SafeLoader, node: yaml.Node) -> Replace:
    if not isinstance(node, yaml.MappingNode):
        raise yaml.constructor.ConstructorError(None, None, "!replace goes on a mapping (a list or value "
                                                "already replaces what the base has)", node.start_mark)
    return Replace(loader.construct_mapping(node, deep=True))


_RecipeLoader.add_constructor("!replace", _replace)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist; give a YAML or TOML file path")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.load(text, Loader=_RecipeLoader) or {}  # noqa: S506 - a SafeLoader
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"recipe {path} is malformed: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def _base_path(recipe: Path, base: Any) -> Path | None:
    if base in NO_BASE:
        return None
    if not isinstance(base, str):
        raise ConfigError(f"recipe {recipe}: base must be 'default', 'none' or a recipe path, got {base!r}")
    if base in BUILTIN_BASES:
        return BUILTIN_BASES[base]
    path = Path(base).expanduser()
    path = path if path.is_absolute() else recipe.parent / path
    if not path.is_file():
        raise ConfigError(f"recipe {recipe}: base {base!r} is not a recipe file ({path} does not exist); "
                          f"give a path relative to the recipe, 'default' or 'none'")
    return path


def read_recipe(path: str | Path) -> tuple[dict[str, Any], Path | None]:
    """A recipe's data with its ``base:`` chain deep-merged under it, and the direct base's path
    (None: the recipe inherits nothing, i.e. the pydantic defaults)."""
    path = Path(path)
    seen: list[Path] = []
    layers: list[dict[str, Any]] = []
    first_base: Path | None = None
    cur: Path | None = path
    while cur is not None:
        if cur.resolve() in seen:
            raise ConfigError(f"recipe {path}: base chain loops back to {cur}; remove one base: key")
        seen.append(cur.resolve())
        data = _read_file(cur)
        nxt = _base_path(cur, data.pop("base", None))
        if cur == path:
            first_base = nxt
        layers.append(data)
        cur = nxt
    merged: dict[str, Any] = {}
    for layer in reversed(layers):
        merged = _deep_merge(merged, layer)
    return merged, first_base


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {p} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _section_model(loc: tuple) -> type[BaseModel] | None:
    """The model class holding the field at ``loc`` (a pydantic error location)."""
    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        f = model.model_fields.get(str(part))
        ann = f.annotation if f is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            model = _section_model(e["loc"])
            hint = did_you_mean(str(e["loc"][-1]), list(model.model_fields)) if model else ""
            where = ".".join(str(x) for x in e["loc"][:-1])
            lines.append(f"{loc}: unknown field{hint}; see `conveyor config {where or 'SECTION'}` for the fields")
        else:
            got = e.get("input")
            got_s = json.dumps(got, default=str)[:60] if not isinstance(got, dict) else "a mapping"
            lines.append(f"{loc or 'config'}: {e['msg']} (got {got_s})")
    return "; ".join(lines)


def recipe_without_file(overrides: list[str]) -> Path:
    """The built-in recipe a command line without a recipe file starts from: the tiny model's
    recipe, or, when it names a model of its own (``model.path=...``), the recipe for pretrained
    models, so the tiny model's hyperparameters never reach a real model."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "model.path" and value.strip() not in ("", "null", "None", "~"):
            return PRETRAINED_RECIPE
    return DEFAULT_RECIPE


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> RunConfig:
    """Validate ``base`` (a mapping), then the recipe at ``path`` (with its own ``base:`` chain)
    merged over it, then the dotted ``overrides``."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = _deep_merge(data, read_recipe(path)[0])
    for item in overrides or []:
        apply_override(data, item)
    return validate(data)


def validate(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def base_config(path: str | Path | None) -> tuple[str, RunConfig]:
    """What the recipe at ``path`` inherits: a label and the config of its base alone
    (the pydantic defaults when it names none)."""
    if path is None:
        return "none (pydantic defaults)", RunConfig()
    _, base = read_recipe(path)
    if base is None:
        return "none (pydantic defaults)", RunConfig()
    label = {DEFAULT_RECIPE: "default (the built-in recipe)",
             PRETRAINED_RECIPE: "pretrained (the built-in recipe for pretrained models)"}.get(base, str(base))
    return label, validate(read_recipe(base)[0])


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and k not in _DICT_FIELDS:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Fields whose value is a mapping: compared whole, not key by key.
_DICT_FIELDS = {"options", "kwargs", "vllm_kwargs"}


def config_diff(cfg: RunConfig, base: RunConfig) -> list[tuple[str, Any, Any]]:
    """``(dotted field, base value, value)`` for every field where ``cfg`` differs from ``base``."""
    a, b = _flat(base.model_dump(mode="json")), _flat(cfg.model_dump(mode="json"))
    return [(k, a.get(k), b[k]) for k in b if a.get(k) != b[k] and k != "output_dir"]


def _short_value(v: Any) -> str:
    return json.dumps(v, default=str) if not isinstance(v, str) else v


def format_diff(diff: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{k}={_short_value(v)}" for k, _, v in diff) or "nothing"


def sections() -> list[str]:
    return [k for k, f in RunConfig.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]


def describe_section(cfg: RunConfig, name: str) -> str:
    """One section's fields: name, current value, default and description, one field per line."""
    parts = name.split(".")
    model: Any = cfg
    for i, part in enumerate(parts):
        fields = type(model).model_fields if isinstance(model, BaseModel) else {}
        if part not in fields or not isinstance(getattr(model, part), BaseModel):
            choices = [k for k in fields if isinstance(getattr(model, k), BaseModel)]
            where = ".".join(parts[:i]) or "the config"
            known = f"sections: {', '.join(choices)}" if choices else f"{where} has fields only"
            raise ConfigError(f"{'.'.join(parts[:i + 1])} is not a section of {where}"
                              f"{did_you_mean(part, choices)}; {known}")
        model = getattr(model, part)
    doc = (type(model).__doc__ or "").strip()
    parent = RunConfig.model_fields[parts[0]].description if len(parts) == 1 else None
    lines = [f"[{name}] {doc or parent or ''}".rstrip()]
    for key, f in type(model).model_fields.items():
        value = getattr(model, key)
        if isinstance(value, BaseModel):
            lines.append(f"  {key}: a section; see `conveyor config {name}.{key}`")
            continue
        default = f.default_factory() if f.default_factory is not None else f.default
        cur = _short_value(value if not isinstance(value, tuple) else list(value))
        dflt = _short_value(default if not isinstance(default, tuple) else list(default))
        changed = "" if value == default else f"   (default {dflt})"
        lines.append(f"  {name}.{key} = {cur}{changed}")
        if f.description:
            lines += textwrap.wrap(f.description, width=100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``b`` over ``a``, mapping by mapping; a ``Replace`` mapping of ``b`` takes the place of
    ``a``'s (and is a plain mapping from then on, so a later layer merges into it again)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, Replace):
            out[k] = _deep_merge({}, dict(v))
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = _deep_merge({}, v) if isinstance(v, dict) else v
    return out


def save_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
