"""The OpenAI-compatible endpoint in front of the rollout engines: every call of an agent recorded as its episode.

- ``Endpoint``; ``await start(engine)`` serves ``/v1/chat/completions``, ``/v1/completions`` and
  ``/v1/models`` on the CALLING event loop, so a call is one ``engine.generate`` there, the same
  path as every other episode turn.
- ``open(task, params)`` returns an ``Episode`` keyed by the API key its client sends; its calls
  are served one at a time, in order, and recorded token by token
  (``episodes.transcript.Transcript``); sampling is the run's, whatever the request asks.
- Tool calls in a reply are parsed (``env.parsers``); refusals are OpenAI error objects.
- ``count(name)`` is told what happened (``agent_calls``, ``malformed_call``, ...).

It knows nothing of agents, rewards or training: requests in, tokens
recorded, replies out.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from conveyor.env.api import EnvFailure, Tool, ToolError
from conveyor.episodes import openai_api as api
from conveyor.episodes.multi_turn import EpisodeLimits, TurnEngine
from conveyor.episodes.transcript import Transcript
from conveyor.net import listen
from conveyor.types import Completion, SamplingParams, Task

log = logging.getLogger(__name__)
EPISODE_HEADER = "x-conveyor-episode"
_CLOSED_KEPT = 65536  # closed keys remembered, so a late call hears "closed" rather than "unknown"


@dataclass(frozen=True)
class EndpointSettings:
    """Where the endpoint listens and how it renders (``config.EndpointConfig``, plus ``env.tool_format``
    and whether plain-text prompts of ``/v1/completions`` get the tokenizer's special tokens)."""
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "policy"
    tools_in_prompt: bool = True
    tool_format: str = "auto"
    add_special_tokens: bool = False


@dataclass
class Episode:
    key: str
    task: Task
    params: SamplingParams
    engine: TurnEngine
    transcript: Transcript
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The model's replies as the client will send them back -> the text the model sampled.
    replies: dict[str, str] = field(default_factory=dict)
    closed: bool = False
    budget_hit: bool = False
    failure: EnvFailure | None = None
    last_reply_at: float = field(default_factory=time.perf_counter)
    generate_s: float = 0.0
    client_s: float = 0.0


def _client_tool(t: api.FunctionTool) -> Tool:
    def run_by_client(**_: Any) -> str:
        raise ToolError(f"tool {t.name} runs in the client that declared it, not in the environment pool")
    return Tool(t.name, t.description, dict(t.parameters), run_by_client)


def _signature(content: str | None, calls: Sequence[tuple[str, Any]]) -> str:
    """How a reply is recognised when the client sends it back: its text and its calls, whitespace
    around the text and the JSON spelling of the arguments aside."""
    return json.dumps([(content or "").strip(), [[n, a] for n, a in calls]], sort_keys=True, ensure_ascii=False,
                      default=str)


class Endpoint:
    """The OpenAI-compatible endpoint; each call recorded as its episode's.

    - ``Endpoint(tokenizer, settings, limits, count)``; ``await start(engine)`` serves
      ``/v1/chat/completions`` (tools and tool calls in OpenAI's format, SSE
      streaming or not), ``/v1/completions`` and ``/v1/models`` (uvicorn +
      starlette) on ``settings.host:settings.port`` (port 0: a free one;
      ``base_url`` says which) on the CALLING event loop: the loop that routes
      turns to the engine workers (``episodes.runner``), so a call is one
      ``engine.generate`` there, the same path as every other episode turn, for
      the native engine, vLLM and remote engines alike.
    - ``open(task, params, engine=None)`` returns an ``Episode`` whose ``key`` is
      the API key its client sends (``Authorization: Bearer <key>``, or the
      ``X-Conveyor-Episode`` header, which wins). Its calls are served one at a
      time, in order, and recorded by a ``episodes.transcript.Transcript``: each
      request's messages are rendered by the chat template (the model's own
      replies rendered as the text it sampled, recognised by their content and
      tool calls), matched against the recorded tokens and only the new suffix is
      appended; the engine continues the recorded ids. Sampling is the episode's
      ``params`` (the run's), whatever the request asks; ``max_tokens`` and
      ``stop`` of a request narrow it. ``close(key)`` ends the episode: later
      calls with its key get 410.
    - A reply's text is parsed for tool calls (``env.parsers``, the configured
      format) against the request's tools; calls that parse and check become
      ``tool_calls`` (``finish_reason: tool_calls``); a malformed call is
      returned as text and counted (``malformed_call``).
    - Refusals are OpenAI error objects: 400 (bad JSON or fields, a tool schema
      that is not JSON schema, a call past the episode's turn or token budget:
      ``episode_budget_exhausted``, a prompt past the context), 401 (no key or
      an unknown one), 404 (unknown model or route), 410 (a closed episode, or
      the run ended: ``end()``), 500 (the endpoint failed on the call: the
      episode is not trained), 503 (the engine did not answer in time).
    - ``count(name)`` is told ``agent_calls``, ``rewritten_calls``,
      ``malformed_call``, ``bad_requests``, ``budget_exhausted``.
    """
    def __init__(self, tokenizer, settings: EndpointSettings, limits: EpisodeLimits, count: Callable[[str], None]):
        self.tok, self.settings, self.limits, self.count = tokenizer, settings, limits, count
        self.base_url = ""
        self._episodes: dict[str, Episode] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._ended = False
        self._engine: TurnEngine | None = None
        self._server: Any = None
        self._serving: asyncio.Task | None = None
        self._stop_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()

    # ----- lifecycle (on the event loop) -----------------------------------------------
    async def start(self, engine: TurnEngine, timeout_s: float = 30.0) -> str:
        """Serve on this loop; returns ``base_url`` (``http://host:port/v1``)."""
        import uvicorn
        self._engine = engine
        sock = _bind(self.settings.host, self.settings.port)
        host, port = sock.getsockname()[:2]
        # Keep-alive: idle connections are held longer than clients keep theirs (httpx: 5 s), so a
        # client never reuses a connection the server is closing at that moment (a lost call: the
        # trainer's step can leave every connection idle for seconds).
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off", ws="none",
                                timeout_graceful_shutdown=3, timeout_keep_alive=75, backlog=4096)
        self._server = uvicorn.Server(config)
        self._serving = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._serving.done() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"the OpenAI-compatible endpoint did not start on {host}:{port} within "
                                   f"{timeout_s:g}s" + (f": {self._serving.exception()}" if self._serving.done()
                                                          and self._serving.exception() else ""))
            await asyncio.sleep(0.01)
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{port}/v1"
        log.info("OpenAI-compatible endpoint at %s (model %r)", self.base_url, self.settings.model)
        return self.base_url

    def end(self) -> None:
        """The run ended: every later call is refused (410 ``run_ended``)."""
        self._ended = True
        for key in list(self._episodes):
            self.close(key)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self.end()
        if self._server is None or self._serving is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._serving, timeout_s)
        except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - stopping is best effort
            log.info("endpoint: the server did not stop cleanly: %s", e)

    # ----- episodes ----------------------------------------------------------------------
    def open(self, task: Task, params: SamplingParams, engine: TurnEngine | None = None) -> Episode:
        if self._ended:
            raise EnvFailure("crash", "the OpenAI-compatible endpoint has stopped; no episode can start")
        key = "ep-" + secrets.token_hex(16)
        ep = Episode(key, task, params, engine or self._engine,
                     Transcript(self.limits, lambda ids: self.tok.decode(list(ids), skip_special_tokens=False),
                                lambda ids: self.tok.decode(list(ids), skip_special_tokens=True)))
        self._episodes[key] = ep
        return ep

    def close(self, key: str) -> Episode | None:
        ep = self._episodes.pop(key, None)
        if ep is not None:
            ep.closed = True
            self._closed[key] = ep.task.id
            while len(self._closed) > _CLOSED_KEPT:
                self._closed.popitem(last=False)
        return ep

    def _episode(self, headers) -> Episode:
        key = headers.get(EPISODE_HEADER)
        if not key:
            auth = headers.get("authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not key:
            raise api.ApiError(401, "no episode key: send the api_key the agent was given (Authorization: Bearer "
                                    "<key>) or an X-Conveyor-Episode header", code="missing_episode_key",
                               kind="authentication_error")
        if self._ended:
            raise api.ApiError(410, "the training run has ended; this endpoint takes no more calls",
                               code="run_ended")
        if key in self._closed:
            raise api.ApiError(410, f"episode {key[:12]}... (task {self._closed[key]!r}) is closed: its agent "
                                    "returned or ran past env.endpoint.episode_timeout_s", code="episode_closed")
        ep = self._episodes.get(key)
        if ep is None:
            raise api.ApiError(401, f"unknown episode key {key[:12]!r}...: each episode's agent gets its own key; "
                                    "use the one it was given", code="invalid_api_key", kind="authentication_error")
        return ep

    # ----- HTTP ----------------------------------------------------------------------------
    def app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route
        routes = [Route("/v1/chat/completions", self._chat, methods=["POST"]),
                  Route("/v1/completions", self._text, methods=["POST"]),
                  Route("/v1/models", self._models, methods=["GET"]),
                  Route("/v1/models/{model:path}", self._model, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})

    async def _http_error(self, request, exc):
        from starlette.responses import JSONResponse
        err = api.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; this endpoint "
                                            "serves POST /v1/chat/completions, POST /v1/completions, GET /v1/models",
                           code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    async def _models(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse(api.models_list(self.settings.model))

    async def _model(self, request):
        from starlette.responses import JSONResponse
        name = request.path_params["model"]
        if name != self.settings.model:
            return JSONResponse(self._unknown_model(name).body(), status_code=404)
        return JSONResponse(api.models_list(name)["data"][0])

    def _unknown_model(self, name: str) -> api.ApiError:
        return api.ApiError(404, f"the model {name!r} does not exist; this endpoint serves {self.settings.model!r} "
                                 "(env.endpoint.model)", param="model", code="model_not_found")

    async def _chat(self, request):
        return await self._serve(request, chat=True)

    async def _text(self, request):
        return await self._serve(request, chat=False)

    async def _serve(self, request, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse
        try:
            body = api.parse_json(await request.body())
            req = api.parse_chat(body) if chat else api.parse_text(body)
            if req.model != self.settings.model:
                raise self._unknown_model(req.model)
            ep = self._episode(request.headers)
            async with ep.lock:  # an episode is one sequence: its calls are recorded one after another
                try:
                    reply = await self._call(ep, req)
                except api.ApiError:
                    raise
                except Exception as e:  # a bug here: the episode is not trained, the client hears why
                    log.exception("endpoint: a call of the episode of task %s failed", ep.task.id)
                    ep.failure = EnvFailure("crash", f"the endpoint failed on a call: {type(e).__name__}: {e}")
                    raise api.ApiError(500, f"the endpoint failed on this call: {type(e).__name__}: {e}",
                                       code="internal_error", kind="server_error") from None
        except api.ApiError as e:
            self.count("bad_requests")
            return JSONResponse(e.body(), status_code=e.status)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        model = self.settings.model
        if not req.stream:
            make = api.chat_completion if chat else api.text_completion
            return JSONResponse(make(rid, model, reply, req.logprobs))
        chunks = (api.chat_chunks if chat else api.text_chunks)(rid, model, reply, req.logprobs, req.include_usage)

        async def events():
            # The turn is generated whole (an engine worker answers a turn at once), then sent as chunks.
            for c in chunks:
                yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ----- one model call of an episode ---------------------------------------------------------
    async def _call(self, ep: Episode, req: api.ChatRequest | api.TextRequest) -> api.Reply:
        if ep.closed:
            raise api.ApiError(410, f"the episode of task {ep.task.id!r} is closed", code="episode_closed")
        if ep.failure is not None:
            raise api.ApiError(503, f"the episode of task {ep.task.id!r} failed: {ep.failure}", code="episode_failed",
                               kind="server_error")
        chat = isinstance(req, api.ChatRequest)
        tools = tuple(_client_tool(t) for t in req.tools) if chat and req.tool_choice != "none" else ()
        rendered = self._render(ep, req, tools) if chat else self._prompt_ids(req.prompt)
        tr = ep.transcript
        if tr.calls >= self.limits.max_turns:
            self._budget(ep, f"the episode made its env.max_turns={self.limits.max_turns} model calls")
        covered = tr.covered(rendered)
        room = tr.room_after(rendered, covered)
        if tr.calls == 0 and len(rendered) >= self.limits.context_limit:
            raise api.ApiError(400, f"the request renders to {len(rendered)} tokens; the model's context is "
                                    f"{self.limits.context_limit}", param="messages" if chat else "prompt",
                               code="context_length_exceeded")
        if room <= 0:
            self._budget(ep, f"no room left in the episode's token budget (env.max_tokens "
                             f"{self.limits.max_tokens}, context {self.limits.context_limit})")
        if not tr.extend(rendered, covered):
            self.count("rewritten_calls")
            log.info("episode of task %s: call %d rewrote the history", ep.task.id, tr.calls + 1)
        self.count("agent_calls")
        client_s = time.perf_counter() - ep.last_reply_at
        ep.client_s += client_s
        params = self._params(ep, req, room)
        g0 = time.perf_counter()
        try:
            c = await ep.engine.generate(list(tr.ids), params)
        except EnvFailure as e:
            ep.failure = e
            raise api.ApiError(503, f"the engine did not answer: {e}", code="engine_timeout",
                               kind="server_error") from None
        ep.generate_s += time.perf_counter() - g0
        if ep.closed:  # the episode's deadline passed while the engine worked
            raise api.ApiError(410, f"the episode of task {ep.task.id!r} closed while its call was generated",
                               code="episode_closed")
        reply, names, error = self._reply(c, req, tools, len(tr.ids))
        if error:
            self.count(error)
        tr.add(c, self._stop_ids | set(params.stop_token_ids), names, client_s, error)
        ep.replies[_signature(reply.content, [(k.name, dict(k.arguments)) for k in reply.calls])] = \
            self._sampled_text(c)
        ep.last_reply_at = time.perf_counter()
        return reply

    def _budget(self, ep: Episode, why: str) -> None:
        ep.budget_hit = True
        self.count("budget_exhausted")
        raise api.ApiError(400, f"episode of task {ep.task.id!r}: {why}; what it recorded is kept, and its "
                                "agent's return decides its reward", code="episode_budget_exhausted")

    def _params(self, ep: Episode, req, room: int) -> SamplingParams:
        cap = min(ep.params.max_new_tokens, room, req.max_tokens or room)
        seed = ep.params.seed
        # Each call draws from a stream of its own (as run_episode's turn t draws at seed + t).
        return dataclasses.replace(ep.params, n=1, max_new_tokens=max(1, cap),
                                   stop_strings=tuple(ep.params.stop_strings) + tuple(req.stop),
                                   seed=None if seed is None else seed + ep.transcript.calls)

    def _render(self, ep: Episode, req: api.ChatRequest, tools: tuple[Tool, ...]) -> list[int]:
        from conveyor.env.chat import render_prompt
        messages = []
        for m in req.messages:
            if m["role"] == "assistant":
                calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", ())]
                sampled = ep.replies.get(_signature(m["content"], calls))
                if sampled is not None:  # the model's own reply: rendered as the text it sampled
                    m = {"role": "assistant", "content": sampled}
            messages.append(m)
        shown = tools if self.settings.tools_in_prompt else ()
        try:
            text = render_prompt(self.tok, messages, shown)
        except Exception as e:  # noqa: BLE001 - a template's own error about these messages
            raise api.ApiError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                               param="messages") from None
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _prompt_ids(self, prompt: str | tuple[int, ...]) -> list[int]:
        if isinstance(prompt, tuple):
            vocab = len(self.tok)
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise api.ApiError(400, f"prompt has token ids outside [0, {vocab})", param="prompt")
            return list(prompt)
        return list(self.tok(prompt, add_special_tokens=self.settings.add_special_tokens)["input_ids"])

    def _sampled_text(self, c: Completion) -> str:
        """The reply's tokens as text, special tokens kept and a final stop token dropped (the
        template writes its own end of turn)."""
        ids = list(c.token_ids)
        if ids and c.finish_reason == "stop" and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=False)

    def _reply(self, c: Completion, req, tools: tuple[Tool, ...], prompt_tokens: int
               ) -> tuple[api.Reply, tuple[str, ...], str]:
        """(the reply, the names of its tool calls, a failure class or "")."""
        from conveyor.env.parsers import check_call, parse_tool_calls
        text = c.text
        cut = [text.find(s) for s in req.stop if s in text]
        if cut:  # OpenAI's replies end before the stop sequence
            text = text[:min(cut)]
        finish = {"stop": "stop", "length": "length"}.get(c.finish_reason, "length")
        tokens = tuple((self.tok.decode([t], skip_special_tokens=False), float(lp))
                       for t, lp in zip(c.token_ids, c.logprobs))
        if tools:
            turn = parse_tool_calls(text, self.settings.tool_format, tools)
            bad = [e.kind for e in turn.errors] + [p.kind for p in (check_call(k, list(tools)) for k in turn.calls)
                                                   if p is not None]
            if turn.calls and not bad:
                calls = tuple(api.Call(k.name, dict(k.arguments)) for k in turn.calls)
                return (api.Reply(turn.content.strip() or None, calls, "tool_calls", prompt_tokens, tokens),
                        tuple(k.name for k in calls), "")
            if bad:  # the model tried to call and failed: the client reads its text, the pool counts it
                return api.Reply(text, (), finish, prompt_tokens, tokens), (), bad[0]
        return api.Reply(text, (), finish, prompt_tokens, tokens), (), ""


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: the system picks a free one)."""
    try:
        return listen(host, port)
    except OSError as e:
        raise RuntimeError(f"the OpenAI-compatible endpoint cannot listen on {host}:{port} ({e}); set "
                           "env.endpoint.host / env.endpoint.port to a free local address (port 0: any)") from None
