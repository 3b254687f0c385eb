"""Serve any reward over HTTP with batching (``conveyor serve-reward``); the wire is ``remote.py``'s.

- ``RewardServer(reward, settings, name)`` serves a ``RewardFn`` or an ``api.BatchReward`` on
  the CALLING event loop; ``serve(spec, kwargs, settings)`` is the blocking command.
- Items of every request join one queue and are scored in batches, each under a deadline;
  every request is answered, a failed item with ``{"error": ...}``.
- Bad requests are HTTP 400 naming the problem; ``GET /health`` and ``GET /stats`` report.

It knows nothing of runs, trainers or the client's retries and fallbacks.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import numbers
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from conveyor.net import listen
from conveyor.reward.api import BatchReward, RewardError, load_reward, reward_name
from conveyor.reward.remote import WIRE_VERSION, WireError, WireTrajectory
from conveyor.types import Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 0
    max_batch: int = 64
    batch_wait_ms: float = 10.0
    workers: int = 4
    timeout_s: float = 30.0
    max_request_items: int = 4096

    def __post_init__(self) -> None:
        if not (self.max_batch >= 1 and self.workers >= 1 and self.max_request_items >= 1
                and math.isfinite(self.batch_wait_ms) and self.batch_wait_ms >= 0
                and math.isfinite(self.timeout_s) and self.timeout_s > 0 and 0 <= self.port < 65536):
            raise ValueError(f"serve-reward settings {self}: max_batch, workers >= 1, batch_wait_ms >= 0, "
                             "timeout_s > 0 and a port in 0..65535")


class _Item:
    __slots__ = ("traj", "future", "queued_at")

    def __init__(self, traj: Trajectory, future: asyncio.Future) -> None:
        self.traj, self.future, self.queued_at = traj, future, time.monotonic()


class RewardServer:
    """- ``RewardServer(reward, settings, name)``: ``reward`` is a ``RewardFn`` or an
      ``api.BatchReward``. ``await start()`` listens on ``settings.host:settings.port`` (port 0: a
      free one; ``url`` says which) on the CALLING event loop (starlette + uvicorn); ``await
      stop()`` ends it. ``serve(spec, kwargs, settings)`` is the blocking command: it loads the
      reward (``api.load_reward``), prints one line naming the URL, and serves until SIGINT or
      SIGTERM, then closes a ``BatchReward``.
    - Batching: every item of every ``POST /v1/score`` joins one queue; a batch starts once
      ``max_batch`` items wait or the oldest has waited ``batch_wait_ms``, once a worker is free
      (so under load batches fill by themselves). A ``BatchReward`` scores a batch in one
      ``score_batch`` call (at most its own ``max_batch`` items per call), up to ``workers`` calls
      at once; a ``RewardFn`` scores one batch at a time, each item a call on one of ``workers``
      threads. Each batch has a deadline of
      ``timeout_s``: items past it answer ``{"error": "timeout ..."}`` (the thread is abandoned,
      counted ``stuck``); a reward that raises or returns something other than a finite number
      or a dict with one gives its items ``{"error": ...}``. Every request is answered.
    - Refusals (HTTP 400, ``{"error": ...}``): a body that is not JSON, another wire version, a
      malformed item (the message names its index and field), more than ``max_request_items``.
    - ``GET /health``: ``{"status": "ok", "version", "reward", "max_batch", "batch_wait_ms"}``;
      ``GET /stats``: counters (``requests``, ``items``, ``batches``, ``calls`` (reward calls),
      ``largest_batch``, ``errors``, ``timeouts``, ``stuck``, ``bad_requests``).
    """
    def __init__(self, reward: Any, settings: ServeSettings = ServeSettings(), name: str | None = None) -> None:
        self.reward, self.settings = reward, settings
        self.batched = isinstance(reward, BatchReward)
        self.name = name or (reward.name if self.batched else reward_name(reward))
        self._threads = ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="reward-server")
        self.counts = {k: 0 for k in ("requests", "items", "batches", "calls", "largest_batch", "errors",
                                      "timeouts", "stuck", "bad_requests")}
        self.url = ""
        self._queue: asyncio.Queue[_Item] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: list[asyncio.Task] = []
        self._batches: set[asyncio.Task] = set()  # referenced until done (the loop keeps weak ones)
        self._server = None

    # ----- lifecycle (on the event loop) -----------------------------------------------
    async def start(self, timeout_s: float = 30.0) -> str:
        try:
            import starlette  # noqa: F401 - the app's framework, imported where it is built
            import uvicorn
        except ImportError as e:
            raise RewardError(f"the reward server needs starlette and uvicorn ({e}): pip install "
                              "'conveyor[agents]'") from None
        # A BatchReward: up to `workers` score_batch calls at once; a RewardFn: one batch at a
        # time, its items spread over the `workers` threads.
        self._queue = asyncio.Queue()
        self._slots = asyncio.Semaphore(self.settings.workers if self.batched else 1)
        sock = _bind(self.settings.host, self.settings.port)
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off", ws="none",
                                timeout_graceful_shutdown=3, backlog=4096)
        self._server = uvicorn.Server(config)
        loop = asyncio.get_running_loop()
        serving = loop.create_task(self._server.serve(sockets=[sock]))
        self._tasks = [serving, loop.create_task(self._batcher())]
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if serving.done() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"the reward server did not start on {host}:{port} within {timeout_s:g}s")
            await asyncio.sleep(0.01)
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        return self.url

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        for task in self._tasks[1:]:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        self._threads.shutdown(wait=False, cancel_futures=True)

    def app(self):
        from starlette.applications import Starlette
        from starlette.routing import Route
        return Starlette(routes=[Route("/health", self._health, methods=["GET"]),
                                 Route("/stats", self._stats, methods=["GET"]),
                                 Route("/v1/score", self._score, methods=["POST"])])

    # ----- HTTP ------------------------------------------------------------------------
    async def _health(self, request):
        from starlette.responses import JSONResponse
        s = self.settings
        return JSONResponse({"status": "ok", "version": WIRE_VERSION, "reward": self.name,
                             "max_batch": s.max_batch, "batch_wait_ms": s.batch_wait_ms})

    async def _stats(self, request):
        from starlette.responses import JSONResponse
        return JSONResponse(dict(self.counts))

    async def _score(self, request):
        from starlette.responses import JSONResponse
        self.counts["requests"] += 1
        try:
            trajs = _parse_request(await request.body(), self.settings.max_request_items)
        except WireError as e:
            self.counts["bad_requests"] += 1
            return JSONResponse({"error": str(e)}, status_code=400)
        loop = asyncio.get_running_loop()
        items = [_Item(t, loop.create_future()) for t in trajs]
        self.counts["items"] += len(items)
        for item in items:
            self._queue.put_nowait(item)
        # Each batch ends within timeout_s of its start; this bound only guards against a bug.
        limit = self.settings.timeout_s * (math.ceil(self._queue.qsize() / self.settings.max_batch) + 2) + 5.0
        done, _ = await asyncio.wait([i.future for i in items], timeout=limit)
        results = [i.future.result() if i.future in done else {"error": "not scored in time"} for i in items]
        return JSONResponse({"version": WIRE_VERSION, "results": results})

    # ----- batching --------------------------------------------------------------------
    async def _batcher(self) -> None:
        s = self.settings
        while True:
            await self._slots.acquire()  # items gather while every worker is busy
            first = await self._queue.get()
            batch = [first]
            while len(batch) < s.max_batch:
                left = first.queued_at + s.batch_wait_ms / 1e3 - time.monotonic()
                if left <= 0 and self._queue.empty():
                    break
                try:
                    batch.append(self._queue.get_nowait() if not self._queue.empty()
                                 else await asyncio.wait_for(self._queue.get(), left))
                except asyncio.TimeoutError:
                    break
            task = asyncio.get_running_loop().create_task(self._run_batch(batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _run_batch(self, batch: list[_Item]) -> None:
        self.counts["batches"] += 1
        self.counts["largest_batch"] = max(self.counts["largest_batch"], len(batch))
        trajs = [i.traj for i in batch]
        try:
            if self.batched:
                step = max(1, int(self.reward.max_batch))
                calls = [(trajs[a:a + step], self.reward.score_batch) for a in range(0, len(trajs), step)]
            else:
                calls = [([t], lambda one: [self.reward(one[0])]) for t in trajs]
            submitted = [self._threads.submit(_call, fn, part) for part, fn in calls]
            futures = [asyncio.wrap_future(f) for f in submitted]
            self.counts["calls"] += len(futures)
            _, pending = await asyncio.wait(futures, timeout=self.settings.timeout_s)
            results: list[dict] = []
            for fut, sub, (part, _) in zip(futures, submitted, calls):
                if fut in pending:
                    # Not started yet: cancelled. Running: abandoned (a thread cannot be killed).
                    if not sub.cancel():
                        self.counts["stuck"] += 1
                    self.counts["timeouts"] += len(part)
                    why = f"timeout: the reward did not return within {self.settings.timeout_s:g}s of the batch's start"
                    results += [{"error": why}] * len(part)
                else:
                    results += fut.result()
        except Exception as e:  # noqa: BLE001 - the server itself failed (closing): every item still answers
            results = [{"error": f"the server failed to score: {type(e).__name__}: {e}"}] * len(batch)
        finally:
            self._slots.release()
        for item, result in zip(batch, results):
            if "error" in result:
                self.counts["errors"] += 1
            if not item.future.done():
                item.future.set_result(result)


def _call(fn: Callable[[Sequence[Trajectory]], Sequence[Any]], part: list[Trajectory]) -> list[dict]:
    """One reward call on a thread: its outputs as wire results (never raises)."""
    try:
        outs = list(fn(part))
    except BaseException as e:  # noqa: BLE001 - a reward's failure is its items' error
        return [{"error": f"raised {type(e).__name__}: {str(e)[:200]}"}] * len(part)
    if len(outs) != len(part):
        return [{"error": f"the reward returned {len(outs)} results for {len(part)} items"}] * len(part)
    return [_result(out) for out in outs]


def _result(out: Any) -> dict:
    info: Mapping[str, Any] = {}
    value = out
    if isinstance(out, Mapping):
        info, value = {k: v for k, v in out.items() if k != "reward"}, out.get("reward")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return {"error": f"wrong type: the reward returned {type(value).__name__}, not a number"}
    if not math.isfinite(float(value)):
        return {"error": f"nonfinite: the reward returned {value}"}
    return {"reward": float(value), "info": {str(k): _jsonable(v) for k, v in info.items()}}


def _jsonable(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, numbers.Real):
        f = float(v)
        return (int(v) if isinstance(v, numbers.Integral) else f) if math.isfinite(f) else str(f)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def _parse_request(body: bytes, max_items: int) -> list[Trajectory]:
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise WireError(f"the body is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise WireError("the body must be a JSON object {\"version\", \"items\"}")
    if doc.get("version") != WIRE_VERSION:
        raise WireError(f"wire version {doc.get('version')!r}; this server speaks {WIRE_VERSION}")
    items = doc.get("items")
    if not isinstance(items, list) or not items:
        raise WireError("\"items\" must be a non-empty list of trajectories")
    if len(items) > max_items:
        raise WireError(f"{len(items)} items in one request; at most {max_items}")
    return [WireTrajectory.from_json(d, f"items[{i}]").trajectory() for i, d in enumerate(items)]


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: the system picks a free one)."""
    try:
        return listen(host, port)
    except OSError as e:
        raise RewardError(f"the reward server cannot listen on {host}:{port} ({e}); choose a free --host / "
                          "--port (--port 0: any free port)") from None


def serve(spec: str, kwargs: Mapping[str, Any] | None, settings: ServeSettings,
          say: Callable[[str], None] = print) -> None:
    """Load ``spec`` and serve it until SIGINT / SIGTERM (``conveyor serve-reward``)."""
    reward = load_reward(spec, kwargs)

    async def main() -> None:
        server = RewardServer(reward, settings)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        url = await server.start()
        mode = "one score_batch call per batch" if server.batched else f"{settings.workers} threads"
        say(f"serving reward {server.name!r} at {url} (max batch {settings.max_batch}, wait "
            f"{settings.batch_wait_ms:g} ms, {mode}); reward.fn: {url}")
        await stop.wait()
        await server.stop()

    try:
        asyncio.run(main())
    finally:
        if isinstance(reward, BatchReward):
            reward.close()
