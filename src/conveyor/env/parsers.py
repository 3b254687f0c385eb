"""Tool calls out of a model turn's text, checked against the tools' JSON schemas.

- ``parse_tool_calls(text, fmt, tools) -> ParsedTurn`` never raises on model output: what it
  cannot read becomes a ``ParseError`` (kind ``malformed_call``), the rest of the text is
  ``content``. Formats: ``hermes``, ``llama3``, ``plain``, ``auto`` (``parse_tool_calls`` says
  what each reads).
- ``check_call(call, tools) -> ToolError | None``: ``unknown_tool`` or ``bad_arguments`` (a
  JSON-schema subset, ``check_call`` names it). ``tool_problem(tool)``: what is wrong with a
  tool's declaration.
- ``format_tool_result(name, text)`` is ``"<name>: <text>"``; ``format_error(message)`` is
  ``"error: <message>"``: the observation texts the model reads.

This module knows no tokenizer, no engine and no pool: text in, calls and errors out.
"""
from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.env.api import Tool, ToolCall, ToolError

# Model text parsed as Python: a literal like 2x is a SyntaxError (answered as such), and
# Python also warns about it on stderr, which would reach the console once per form.
warnings.filterwarnings("ignore", category=SyntaxWarning, module="<tool-call>")

FORMATS = ("hermes", "llama3", "plain", "auto")
PARSE_ERROR_KINDS = ("malformed_call",)


@dataclass(frozen=True)
class ParseError:
    """A call the parser saw but could not read: its kind, a one-line message, the raw text."""
    kind: str
    message: str
    raw: str = ""

    def __post_init__(self):
        if self.kind not in PARSE_ERROR_KINDS:
            raise ValueError(f"ParseError kind {self.kind!r} is not one of {PARSE_ERROR_KINDS}")


@dataclass(frozen=True)
class ParsedTurn:
    """One model turn: the calls found, the calls that could not be read, the text outside them."""
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[ParseError, ...] = ()
    content: str = ""

    @property
    def found(self) -> bool:
        return bool(self.calls or self.errors)


def parse_tool_calls(text: str, fmt: str, tools: Sequence[Tool]) -> ParsedTurn:
    """The tool calls in ``text`` in format ``fmt`` (one of ``FORMATS``); never raises on ``text``.

    Formats:
    - ``"hermes"`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}
      </tool_call>``, any number of them. ``arguments`` may also be a JSON string holding a
      JSON object; ``parameters`` is accepted for ``arguments``; a body that is not JSON but a
      Python dict literal (single quotes) is accepted too. A ``<tool_call>`` with no closing
      tag is a malformed call (a truncated turn), even when its JSON is complete.
    - ``"llama3"`` (Llama 3.1 / 3.2 JSON tool calls): the whole turn, after an optional
      ``<|python_tag|>`` and without trailing ``<|eom_id|>`` / ``<|eot_id|>``, is one JSON
      object ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted) or several
      separated by ``;``. Text after the last object is content. A turn that does not start
      with ``{`` has no call; one that starts with ``{`` but is not a call object is content,
      unless it had ``<|python_tag|>`` or a ``"name"`` key (then it is malformed).
    - ``"plain"`` (a fallback for small models): a line that is ``name(...)``, optionally in
      backticks, where ``name`` is one of the given tools (other names are prose, so
      ``f(x)`` in a math answer is never a call). Inside the parentheses: nothing; or Python
      call arguments with keywords (``key=value``, after optional positional values), or
      several positional values when the tool has several parameters: each a Python literal,
      else its source text; or ``key=text`` that is not Python (the text, unquoted); or else
      ONE positional value, the whole text: unquoted if it is one string literal, a number
      if it is a number literal and the parameter is numeric, else the text as written.
      Positional values fill the required parameters in order, then the other properties
      in schema order: ``calculator(123*456)`` is ``{"expression": "123*456"}``. Other
      shapes (``<tool>name: {...}</tool>``, ``Action:`` lines) are not recognised.
    - ``"auto"``: hermes, then llama3, then plain; the first that finds a call or a
      malformed call wins.
    """
    if fmt not in FORMATS:
        raise ValueError(f"tool call format {fmt!r} is not one of {FORMATS}")
    text = text if isinstance(text, str) else str(text)
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "llama3":
        return _parse_llama3(text)
    if fmt == "plain":
        return _parse_plain(text, tools)
    for parse in (_parse_hermes, _parse_llama3):
        turn = parse(text)
        if turn.found:
            return turn
    return _parse_plain(text, tools)


def format_tool_result(name: str, text: str) -> str:
    """The observation a tool's result becomes: ``"<name>: <text>"``."""
    return f"{name}: {str(text).strip()}"


def format_error(message: str) -> str:
    """The observation an error (parse, check or tool failure) becomes: ``"error: <message>"``."""
    return f"error: {str(message).strip()}"


# ---------------------------------------------------------------------------- hermes

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_RE = re.compile(re.escape(_HERMES_OPEN) + r"(.*?)" + re.escape(_HERMES_CLOSE), re.DOTALL)


def _parse_hermes(text: str) -> ParsedTurn:
    calls, errors, outside, pos = [], [], [], 0
    for m in _HERMES_RE.finditer(text):
        outside.append(text[pos:m.start()])
        pos = m.end()
        result = _call_from_body(m.group(1), m.group(0))
        (calls if isinstance(result, ToolCall) else errors).append(result)
    rest = text[pos:]
    cut = rest.find(_HERMES_OPEN)
    if cut >= 0:
        outside.append(rest[:cut])
        errors.append(ParseError("malformed_call", "<tool_call> has no closing </tool_call>; "
                                 "close each call with </tool_call>", rest[cut:]))
    else:
        outside.append(rest)
    return ParsedTurn(tuple(calls), tuple(errors), _join_content(outside))


def _call_from_body(body: str, raw: str) -> ToolCall | ParseError:
    """A Hermes call body (JSON, or a Python dict literal) as a call, or why not."""
    obj = _loads_object(body.strip())
    if obj is None:
        return ParseError("malformed_call", "tool call is not a JSON object; write "
                          '{"name": ..., "arguments": {...}}', raw)
    return _call_from_object(obj, raw, "arguments")


def _loads_object(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        # Small models write Python dicts (single quotes, True/None); accept the literal.
        try:
            obj = ast.literal_eval(ast.parse(body.lstrip(" \t"), filename="<tool-call>", mode="eval"))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    return obj if isinstance(obj, dict) else None


def _call_from_object(obj: dict, raw: str, args_key: str) -> ToolCall | ParseError:
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParseError("malformed_call", 'tool call has no "name" string', raw)
    other = "parameters" if args_key == "arguments" else "arguments"
    args = obj.get(args_key, obj.get(other, {}))
    if isinstance(args, str):
        # Some templates (and OpenAI's wire format) carry the arguments as a JSON string.
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return ParseError("malformed_call", f"{name}: arguments string is not JSON", raw)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParseError("malformed_call", f"{name}: arguments must be a JSON object, "
                          f"got {type(args).__name__}", raw)
    return ToolCall(name, args, raw)


# ---------------------------------------------------------------------------- llama3

_PYTHON_TAG = "<|python_tag|>"
_LLAMA_END = re.compile(r"(\s*(<\|eom_id\|>|<\|eot_id\|>))+\s*$")


def _parse_llama3(text: str) -> ParsedTurn:
    body = _LLAMA_END.sub("", text).strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return ParsedTurn((), (), text.strip())
    decoder, calls, errors, pos = json.JSONDecoder(), [], [], 0
    while True:
        try:
            obj, end = decoder.raw_decode(body, pos)
        except (ValueError, RecursionError):
            if tagged or calls or '"name"' in body[pos:pos + 200]:
                errors.append(ParseError("malformed_call", "tool call is not valid JSON; write "
                                         '{"name": ..., "parameters": {...}}', body[pos:]))
                return ParsedTurn(tuple(calls), tuple(errors), "")
            return ParsedTurn((), (), text.strip())
        raw = body[pos:end]
        if not isinstance(obj, dict) or ("name" not in obj and not tagged):
            if not calls:  # a JSON answer, not a call
                return ParsedTurn((), (), text.strip())
            errors.append(ParseError("malformed_call", 'tool call has no "name"', raw))
        else:
            result = _call_from_object(obj, raw, "parameters")
            (calls if isinstance(result, ToolCall) else errors).append(result)
        rest = body[end:].lstrip()
        if not rest.startswith(";"):
            return ParsedTurn(tuple(calls), tuple(errors), rest.strip())
        pos = len(body) - len(rest) + 1
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos >= len(body):  # a trailing ';'
            return ParsedTurn(tuple(calls), tuple(errors), "")


# ---------------------------------------------------------------------------- plain

_PLAIN_LINE = re.compile(r"^\s*`*\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*\((.*)\)\s*`*\s*;?\s*$")
_KEYWORD_START = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(?!=)")


def _parse_plain(text: str, tools: Sequence[Tool]) -> ParsedTurn:
    by_name = {t.name: t for t in tools}
    calls, errors, outside = [], [], []
    for line in text.splitlines():
        m = _PLAIN_LINE.match(line)
        if not m or m.group(1) not in by_name:
            outside.append(line)
            continue
        result = _plain_call(by_name[m.group(1)], m.group(2), line.strip())
        (calls if isinstance(result, ToolCall) else errors).append(result)
    return ParsedTurn(tuple(calls), tuple(errors), "\n".join(outside).strip())


def _plain_call(tool: Tool, inner: str, raw: str) -> ToolCall | ParseError:
    inner = inner.strip()
    if not inner:
        return ToolCall(tool.name, {}, raw)
    order = _positional_order(tool.parameters)
    props = tool.parameters.get("properties") or {}
    node = _parse_call_args(inner)
    if node is not None and (node.keywords or (len(node.args) > 1 and len(order) > 1)):
        if any(k.arg is None for k in node.keywords):
            return ParseError("malformed_call", f"{tool.name}: **kwargs are not supported", raw)
        positional = [_value(a, inner) for a in node.args]
        keywords = {k.arg: _value(k.value, inner) for k in node.keywords}
    elif (m := _KEYWORD_START.match(inner)) and m.group(1) in props:
        # ``search(query=capital of France)``: not Python, but the intent is plain.
        positional, keywords = [], {m.group(1): _unquote(inner[m.end():].strip())}
    elif m:
        return ParseError("malformed_call", f"{tool.name}: unknown argument {m.group(1)!r}; "
                          f"write {tool.name}(key=value, ...) with keys {sorted(props)}", raw)
    else:
        positional, keywords = [_single_value(inner, node, props.get(order[0]) if order else None)], {}
    if len(positional) > len(order):
        return ParseError("malformed_call", f"{tool.name} takes {len(order)} positional "
                          f"argument(s), got {len(positional)}", raw)
    args = dict(zip(order, positional))
    for key, value in keywords.items():
        if key in args:
            return ParseError("malformed_call", f"{tool.name}: argument {key!r} given twice", raw)
        args[key] = value
    return ToolCall(tool.name, args, raw)


def _positional_order(schema: Mapping[str, Any]) -> list[str]:
    """Required parameters in order, then the other properties in schema order."""
    props = list((schema.get("properties") or {}).keys())
    required = [r for r in (schema.get("required") or []) if isinstance(r, str)]
    return required + [p for p in props if p not in required]


def _parse_call_args(inner: str) -> ast.Call | None:
    try:
        tree = ast.parse(f"_f({inner})", filename="<tool-call>", mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    body = tree.body
    if isinstance(body, ast.Call) and not any(isinstance(a, ast.Starred) for a in body.args):
        return body
    return None


def _value(node: ast.AST, inner: str) -> Any:
    """A Python literal's value, else its source text (an expression for a string parameter)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return ast.get_source_segment(f"_f({inner})", node) or ""


def _single_value(inner: str, node: ast.Call | None, prop: Any) -> Any:
    """The whole text as one value: a lone string literal unquoted, a number for a numeric
    parameter, else the text itself (``calculator(2 + 3)`` passes ``"2 + 3"``)."""
    if node is not None and len(node.args) == 1 and isinstance(node.args[0], ast.Constant):
        value = node.args[0].value
        if isinstance(value, str):
            return value
        ptype = prop.get("type") if isinstance(prop, Mapping) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and ptype in ("number", "integer"):
            return value
    return inner


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _join_content(parts: list[str]) -> str:
    return "\n".join(p.strip() for p in parts if p.strip())


# ---------------------------------------------------------------------------- check

_JSON_TYPES = {"string": "a string", "number": "a number", "integer": "an integer",
               "boolean": "a boolean", "array": "an array", "object": "an object", "null": "null"}


def check_call(call: ToolCall, tools: Sequence[Tool]) -> ToolError | None:
    """Why ``call`` cannot run against ``tools`` (``unknown_tool`` / ``bad_arguments``), or None.

    JSON-schema subset checked by ``check_call`` (anything else in a schema is ignored):
    ``type`` (string, number, integer, boolean, array, object, null, or a list of them; an
    integer-valued float counts as an integer, a bool is never a number), ``enum``,
    ``properties``, ``required``, ``additionalProperties: false``, ``items`` (one schema),
    recursively.
    """
    by_name = {t.name: t for t in tools}
    tool = by_name.get(call.name)
    if tool is None:
        known = ", ".join(sorted(by_name)) or "none"
        return ToolError(f"unknown tool {call.name!r}; known tools: {known}", "unknown_tool")
    problem = _schema_problem(call.arguments, dict(tool.parameters), "arguments")
    if problem:
        return ToolError(f"{tool.name}: {problem}; expected {_signature(tool)}", "bad_arguments")
    return None


def _signature(tool: Tool) -> str:
    props = tool.parameters.get("properties") or {}
    required = set(tool.parameters.get("required") or [])
    parts = [f"{k}: {(v or {}).get('type', 'any') if isinstance(v, Mapping) else 'any'}"
             + ("" if k in required else " (optional)") for k, v in props.items()]
    return f"{tool.name}({', '.join(parts)})"


_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def tool_problem(tool: Tool) -> str | None:
    """What is wrong with ``tool``'s declaration, or None.

    ``tool_problem(tool) -> str | None``: what is wrong with a tool's declaration
    (its name, or its ``parameters`` as a schema of the subset below: an
    ``object`` schema, known ``type`` names, ``properties`` of schemas,
    ``required`` naming properties, ``enum`` a list, ``items`` one schema); the
    pool's environment is refused before the run when one of its tools has one.
    """
    if not isinstance(tool.name, str) or not _TOOL_NAME.fullmatch(tool.name):
        return f"tool name {tool.name!r} must be 1-64 letters, digits, _ . or -"
    schema = tool.parameters
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        return f"tool {tool.name}: parameters must be a JSON schema of type object, got {schema!r:.120}"
    problem = _declaration_problem(schema, "parameters")
    return f"tool {tool.name}: {problem}" if problem else None


def _declaration_problem(schema: Any, where: str) -> str | None:
    if not isinstance(schema, Mapping):
        return f"{where} must be a schema (a mapping), got {type(schema).__name__}"
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not isinstance(names, list) or not names or any(t not in _JSON_TYPES for t in names):
            return f"{where}.type {types!r} is not a JSON type ({', '.join(_JSON_TYPES)}, or a list of them)"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}.enum must be a list, got {type(schema['enum']).__name__}"
    props = schema.get("properties", {})
    if not isinstance(props, Mapping):
        return f"{where}.properties must map names to schemas, got {type(props).__name__}"
    for key, sub in props.items():
        problem = _declaration_problem(sub, f"{where}.properties.{key}")
        if problem:
            return problem
    required = schema.get("required", [])
    if not isinstance(required, list) or any(not isinstance(r, str) for r in required):
        return f"{where}.required must be a list of property names, got {required!r:.120}"
    missing = [r for r in required if r not in props]
    if missing:
        return f"{where}.required names {missing} that are not in its properties"
    if "items" in schema:
        return _declaration_problem(schema["items"], f"{where}.items")
    return None


def _schema_problem(value: Any, schema: Mapping[str, Any], where: str) -> str | None:
    """The first way ``value`` breaks ``schema`` (the subset ``check_call`` names), or None."""
    if not isinstance(schema, Mapping):
        return None
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, t) for t in types):
            want = " or ".join(_JSON_TYPES.get(t, str(t)) for t in types)
            return f"{where} must be {want}, got {_json_type_name(value)}"
    if "enum" in schema and value not in list(schema["enum"]):
        return f"{where} must be one of {list(schema['enum'])}, got {value!r}"
    if isinstance(value, Mapping):
        props = schema.get("properties") or {}
        for key in schema.get("required") or []:
            if key not in value:
                return f"missing required argument {key!r}" if where == "arguments" \
                    else f"{where} is missing {key!r}"
        for key, item in value.items():
            if key in props:
                problem = _schema_problem(item, props[key], _child(where, key))
                if problem:
                    return problem
            elif schema.get("additionalProperties") is False:
                return f"unknown argument {key!r}" if where == "arguments" \
                    else f"{where} has unknown key {key!r}"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            problem = _schema_problem(item, schema["items"], f"{where}[{i}]")
            if problem:
                return problem
    return None


def _child(where: str, key: str) -> str:
    return repr(key) if where == "arguments" else f"{where}.{key}"


def _is_type(value: Any, t: str) -> bool:
    if t == "string":
        return isinstance(value, str)
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "array":
        return isinstance(value, (list, tuple))
    if t == "object":
        return isinstance(value, Mapping)
    if t == "null":
        return value is None
    return True  # a type outside the subset: not checked


def _json_type_name(value: Any) -> str:
    for t in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _is_type(value, t):
            return f"{_JSON_TYPES[t]} ({_short(value)})"
    return type(value).__name__


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
