"""OpenAI's HTTP API as data: requests checked and normalised, responses and stream chunks built.

- ``parse_chat(body)`` -> ``ChatRequest`` and ``parse_text(body)`` -> ``TextRequest`` raise
  ``ApiError`` (400) naming the field and the fix; ``ApiError.body()`` is OpenAI's error shape.
- Fields that steer sampling are read by nobody: an episode samples with the run's parameters,
  because the trainer recomputes exactly those. Unknown fields are ignored.
- ``chat_completion`` / ``chat_chunks`` / ``text_completion`` / ``text_chunks`` build the
  response objects from a ``Reply``.

It knows no tokenizer, no engine and no episode: JSON in, JSON out.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

ROLES = ("system", "developer", "user", "assistant", "tool")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class ApiError(Exception):
    """A refused request: the HTTP status and OpenAI's error fields.

    ``ApiError(status, message, param=..., code=...)`` is a refusal; ``body()`` is
    OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class FunctionTool:
    """A tool of the request: run by the client; the model is only shown it and its calls parsed."""
    name: str
    description: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict, ...]  # normalised (see ``_message``): what the chat template renders
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: str = "auto"
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False


@dataclass(frozen=True)
class TextRequest:
    model: str
    prompt: str | tuple[int, ...]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False


@dataclass(frozen=True)
class Call:
    """A tool call of the model's reply: the tool's name and its arguments."""
    name: str
    arguments: Mapping[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class Reply:
    """One generated turn as the client sees it. ``content``: the text (without a stop string, and
    without the tool calls when there are any); ``tokens``: (token text, logprob) per token."""
    content: str | None
    calls: tuple[Call, ...]
    finish_reason: str
    prompt_tokens: int
    tokens: tuple[tuple[str, float], ...]


# ----------------------------------------------------------------------------- requests

def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is a JSON {type(body).__name__}; send a JSON object",
                       code="invalid_json")
    return body


def parse_chat(body: Mapping[str, Any]) -> ChatRequest:
    """``parse_chat(body)`` -> ``ChatRequest`` and ``parse_text(body)`` -> ``TextRequest``
    raise ``ApiError`` (400) naming the field and the fix. Accepted: ``messages``
    (system / developer / user / assistant / tool; text content as a string or as
    text parts; assistant ``tool_calls`` whose ``arguments`` are JSON), ``tools``
    (functions whose ``parameters`` are a JSON schema of an object, checked with
    ``jsonschema``), ``tool_choice`` ``auto`` / ``none``, ``stream``,
    ``stream_options.include_usage``, ``max_tokens`` / ``max_completion_tokens``,
    ``stop``, ``logprobs``, ``n`` = 1. Fields that steer sampling (``temperature``,
    ``top_p``, ``seed``, ...) are read by nobody: an episode samples with the run's
    parameters, because the trainer recomputes exactly those. Unknown fields are
    ignored, as OpenAI-compatible servers do.
    """
    model = _model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is missing or empty; send a list of {role, content} objects",
                       param="messages", code="missing_messages" if messages is None else "invalid_messages")
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none"):
        raise ApiError(400, f"tool_choice={json.dumps(tool_choice)} is not supported: the policy chooses its "
                            "own calls (that choice is what is trained); send 'auto' or 'none'", param="tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ApiError(400, "response_format other than {'type': 'text'} is not supported: the policy's own "
                            "text is what is trained", param="response_format")
    stream, usage = _stream(body)
    return ChatRequest(model, tuple(_message(m, i) for i, m in enumerate(messages)), _tools(body.get("tools")),
                       tool_choice, stream, usage, _max_tokens(body), _stop(body.get("stop")),
                       _flag(body, "logprobs"))


def parse_text(body: Mapping[str, Any]) -> TextRequest:
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt given as a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be one non-empty string or one list of token ids (an episode is one "
                            "sequence: one prompt per call)", param="prompt",
                       code="missing_prompt" if prompt is None else "invalid_prompt")
    if body.get("echo"):
        raise ApiError(400, "echo=true is not supported; send echo=false", param="echo")
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
        raise ApiError(400, f"logprobs={lp!r}: send an integer >= 0 or null", param="logprobs")
    stream, usage = _stream(body)
    return TextRequest(model, prompt, stream, usage, _max_tokens(body), _stop(body.get("stop")), lp is not None)


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is missing; send the served model's name (GET /v1/models lists it)",
                       param="model", code="missing_model")
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, f"n={n!r}: an episode is one sequence, so each call samples one choice; send n=1",
                       param="n")
    return model


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name}={value!r}: send true or false", param=name)
    return bool(value)


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _flag(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object such as {\"include_usage\": true}",
                       param="stream_options")
    return stream, bool(opts.get("include_usage", False))


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"{name}={value!r}: send a positive integer", param=name)
        return value
    return None


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise ApiError(400, f"stop={json.dumps(stop)[:60]}: send a non-empty string or a list of up to 4",
                       param="stop")
    return tuple(stops)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content[{j}] is not a text part; only text content is supported",
                               param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where}.content is a {type(content).__name__}; send a string or a list of text parts",
                   param=f"{where}.content")


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, dict) else None
        raise ApiError(400, f"{where}.role is {role!r}; send one of {', '.join(ROLES)}", param=f"{where}.role")
    # 'developer' is OpenAI's newer name for the system message; chat templates know 'system'.
    out: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                           "content": _text(m.get("content"), where)}
    if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    if m["role"] == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    return out


def _tool_call(c: Any, where: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where} has no function.name; send {{type: function, function: {{name, arguments}}}}",
                       param=where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise ApiError(400, f"{where}.function.arguments is not JSON; send the arguments as a JSON object "
                                "string", param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise ApiError(400, f"{where}.function.arguments is not a JSON object", param=f"{where}.function.arguments")
    # The chat templates that render calls expect the arguments as a mapping (they dump it themselves).
    return {"type": "function", "id": c.get("id"), "function": {"name": fn["name"], "arguments": args}}


def _tools(tools: Any) -> tuple[FunctionTool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of {type: function, function: {...}}", param="tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise ApiError(400, f"{where} is not a function tool with a name of letters, digits, '_', '.' or '-' "
                                "(at most 64); send {type: function, function: {name, description, parameters}}",
                           param=where)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _check_schema(params, f"{where}.function.parameters")
        desc = fn.get("description") or ""
        out.append(FunctionTool(fn["name"], desc if isinstance(desc, str) else str(desc), params))
    return tuple(out)


_SCHEMAS_KEPT = 1024
_schema_problems: dict[str, str] = {}  # a schema's JSON -> why it is not a JSON schema ("" when it is)


def _schema_problem(schema: dict) -> str:
    """Checking a schema against the metaschema costs milliseconds; an agent sends the same tools on
    every call, so each distinct schema is checked once."""
    import jsonschema
    key = json.dumps(schema, sort_keys=True, default=str)
    if key not in _schema_problems:
        try:
            jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
            problem = ""
        except jsonschema.SchemaError as e:
            path = "/".join(str(p) for p in e.path)
            problem = e.message + (f" (at {path})" if path else "")
        if len(_schema_problems) >= _SCHEMAS_KEPT:
            _schema_problems.pop(next(iter(_schema_problems)))
        _schema_problems[key] = problem
    return _schema_problems[key]


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ApiError(400, f"{where} is a {type(schema).__name__}, not a JSON schema; send an object schema "
                            "such as {\"type\": \"object\", \"properties\": {...}}", param=where)
    problem = _schema_problem(schema)
    if problem:
        raise ApiError(400, f"{where} is not a JSON schema: {problem}", param=where, code="invalid_tool_schema")
    if schema.get("type", "object") != "object":
        raise ApiError(400, f"{where} has type {schema.get('type')!r}; a function's parameters are an object "
                            "schema (type: object)", param=where, code="invalid_tool_schema")


# ----------------------------------------------------------------------------- responses

def _usage(reply: Reply) -> dict:
    n = len(reply.tokens)
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": n, "total_tokens": reply.prompt_tokens + n}


def _chat_logprobs(reply: Reply) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in reply.tokens], "refusal": None}


def _calls(reply: Reply, indexed: bool) -> list[dict]:
    out = []
    for i, c in enumerate(reply.calls):
        call = {"id": c.id, "type": "function",
                # default=str: a plain-format call may hold a Python literal JSON has no form for
                "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments), ensure_ascii=False,
                                                                      default=str)}}
        out.append({"index": i, **call} if indexed else call)
    return out


def chat_completion(rid: str, model: str, reply: Reply, logprobs: bool) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.calls:
        message["tool_calls"] = _calls(reply, indexed=False)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason,
                         "logprobs": _chat_logprobs(reply) if logprobs else None}],
            "usage": _usage(reply)}


def chat_chunks(rid: str, model: str, reply: Reply, logprobs: bool, include_usage: bool) -> list[dict]:
    """The streamed form of the same reply: a role chunk, the content, the calls, the finish (and usage)."""
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None, lps: dict | None = None) -> dict:
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lps}]}
        if include_usage:
            out["usage"] = None
        return out
    chunks = [chunk({"role": "assistant", "content": ""})]
    if reply.content:
        chunks.append(chunk({"content": reply.content}, lps=_chat_logprobs(reply) if logprobs else None))
    if reply.calls:
        chunks.append(chunk({"tool_calls": _calls(reply, indexed=True)}))
    chunks.append(chunk({}, reply.finish_reason))
    if include_usage:
        chunks.append({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": _usage(reply)})
    return chunks


def _text_logprobs(reply: Reply) -> dict:
    offsets, at = [], 0
    for t, _ in reply.tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": [t for t, _ in reply.tokens], "token_logprobs": [lp for _, lp in reply.tokens],
            "top_logprobs": None, "text_offset": offsets}


def text_completion(rid: str, model: str, reply: Reply, logprobs: bool) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": reply.content or "", "finish_reason": reply.finish_reason,
                         "logprobs": _text_logprobs(reply) if logprobs else None}],
            "usage": _usage(reply)}


def text_chunks(rid: str, model: str, reply: Reply, logprobs: bool, include_usage: bool) -> list[dict]:
    whole = text_completion(rid, model, reply, logprobs)
    whole.pop("usage")
    chunks = [whole]
    if include_usage:
        chunks.append({"id": rid, "object": "text_completion", "created": whole["created"], "model": model,
                       "choices": [], "usage": _usage(reply)})
    return chunks


def models_list(model: str, owner: str = "conveyor") -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": owner}]}
