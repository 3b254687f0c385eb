"""Rewards scored by another process over HTTP: the wire types and the client (``reward.fn: http://host:port``).

- Wire (version ``WIRE_VERSION``): ``POST /v1/score`` and ``GET /health``; a ``WireTrajectory``
  is what a reward reads of a trajectory (token counts, not ids: rewards that read token ids or
  logprobs are not served).
- ``RemoteReward(url, ...)`` is an ``api.BatchReward``; constructing it checks the server's
  health and wire version, raising ``RewardError`` before a run starts.
- ``score_batch`` retries only what may succeed when repeated, within its deadline; what still
  fails raises a ``RemoteRewardFailure`` subclass naming the cause. A circuit breaker stops calls
  to a server that keeps failing.

It knows nothing of how the server scores (``remote_server.py``) or of run configs.
"""
from __future__ import annotations

import http.client
import json
import logging
import math
import numbers
import random
import socket
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from conveyor.resilience import Breaker, backoff_delay
from conveyor.reward.api import RewardError
from conveyor.types import Task, Trajectory, TurnRecord

log = logging.getLogger(__name__)

WIRE_VERSION = 1
MAX_TOKENS = 1 << 22      # a token count above this is refused (the server builds placeholders of it)
MAX_BODY = 64 << 20       # bytes of one answer the client reads


class WireError(ValueError):
    """A request or answer that does not follow the wire format; the message names the field."""


@dataclass(frozen=True)
class WireTrajectory:
    """Wire (version ``WIRE_VERSION``): ``POST /v1/score`` with ``{"version", "items": [WireTrajectory]}``
    answers ``{"version", "results": [{"reward": float, "info": {...}} | {"error": str}]}``, one
    result per item in order; ``GET /health`` answers ``{"status": "ok", "version", "reward",
    "max_batch"}``. A ``WireTrajectory`` is what a reward reads of a trajectory: the task (id,
    prompt, answer, info), the completion text, its finish reason, the prompt's and completion's
    token COUNTS (not the ids), the turn records and the numbers an episode gave beside its
    reward. The server rebuilds a ``Trajectory`` whose ids, logprobs and versions are
    placeholders of the right lengths: rewards that read token ids or logprobs are not served.
    """
    task_id: str
    prompt: str
    answer: str | None
    info: Mapping[str, Any]
    completion: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    turns: tuple[TurnRecord, ...] = ()
    given: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, traj: Trajectory) -> "WireTrajectory":
        given = {k: float(v) for k, v in traj.reward_info.items()
                 if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}
        return cls(traj.task.id, traj.task.prompt, traj.task.answer, dict(traj.task.info), traj.text,
                   traj.finish_reason, len(traj.prompt_ids), len(traj.completion_ids), traj.turn_records, given)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "turns": [asdict(t) for t in self.turns]}

    @classmethod
    def from_json(cls, d: Any, where: str = "item") -> "WireTrajectory":
        if not isinstance(d, dict):
            raise WireError(f"{where} is a {type(d).__name__}, not an object")
        kinds = {"task_id": str, "prompt": str, "info": dict, "completion": str, "finish_reason": str,
                 "prompt_tokens": int, "completion_tokens": int, "turns": list, "given": dict}
        for name, kind in kinds.items():
            if not isinstance(d.get(name), kind) or isinstance(d.get(name), bool):
                raise WireError(f"{where}.{name} must be a {kind.__name__}, got {type(d.get(name)).__name__}")
        if d.get("answer") is not None and not isinstance(d["answer"], str):
            raise WireError(f"{where}.answer must be a string or null")
        for name in ("prompt_tokens", "completion_tokens"):
            if not 0 <= d[name] <= MAX_TOKENS:
                raise WireError(f"{where}.{name}={d[name]} is outside 0..{MAX_TOKENS}")
        try:
            turns = tuple(TurnRecord(**{**t, "tool_calls": tuple(t.get("tool_calls", ()))}) for t in d["turns"])
        except (TypeError, AttributeError) as e:
            raise WireError(f"{where}.turns: {e}") from None
        given = {k: float(v) for k, v in d["given"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return cls(d["task_id"], d["prompt"], d.get("answer"), d["info"], d["completion"], d["finish_reason"],
                   d["prompt_tokens"], d["completion_tokens"], turns, given)

    def trajectory(self) -> Trajectory:
        """The trajectory a reward reads on the server: placeholder ids of the right lengths."""
        n = self.completion_tokens
        return Trajectory(Task(self.task_id, self.prompt, self.answer, self.info), (0,) * self.prompt_tokens,
                          (0,) * n, (0.0,) * n, (0,) * n, (1,) * n, text=self.completion,
                          finish_reason=self.finish_reason, reward_info=dict(self.given),
                          turns=max(1, len(self.turns)), turn_records=self.turns)


class RemoteRewardFailure(RuntimeError):
    """A call to the reward server failed; ``kind`` names the counter (subclasses name the cause)."""
    kind = "failure"


class RemoteTimeout(RemoteRewardFailure):
    kind = "timeout"


class RemoteUnreachable(RemoteRewardFailure):
    kind = "unreachable"


class RemoteServerError(RemoteRewardFailure):
    kind = "server_error"


class RemoteRejected(RemoteRewardFailure):
    kind = "rejected"


class RemoteBadResponse(RemoteRewardFailure):
    kind = "bad_response"


class RemoteBreakerOpen(RemoteRewardFailure):
    kind = "breaker_open"


class _Retryable(Exception):
    """An attempt that may succeed if repeated: connection refused or reset (``RemoteUnreachable``
    if it persists), HTTP 5xx (``RemoteServerError``)."""

    def __init__(self, message: str, final: type[RemoteRewardFailure] = RemoteUnreachable):
        super().__init__(message)
        self.final = final


class RemoteReward:
    """A reward served by ``conveyor serve-reward``.

    - ``RemoteReward(url, timeout_s=4.0, retries=2, backoff_s=0.1, max_batch=64,
      breaker_failures=5, breaker_cooldown_s=10.0, health_timeout_s=10.0)`` is an
      ``api.BatchReward`` (and a ``RewardFn`` through ``__call__``). Constructing it checks
      ``GET /health`` until ``health_timeout_s``: no answer, or another wire version, raises
      ``RewardError`` before a run starts. ``max_batch`` is the smaller of its own and the server's.
    - ``score_batch(trajs)``: one POST per ``max_batch`` trajectories, each under a deadline of
      ``timeout_s`` (retries included; keep it below ``reward.timeout_s``). A refused or broken
      connection and an HTTP 5xx are retried up to ``retries`` times with exponential backoff
      and full jitter (``resilience.backoff_delay``) while the deadline allows; a timeout, an
      HTTP 4xx or a garbled answer is not. What still fails raises a ``RemoteRewardFailure``
      subclass (``RemoteTimeout``, ``RemoteUnreachable``, ``RemoteServerError``,
      ``RemoteRejected``, ``RemoteBadResponse``, ``RemoteBreakerOpen``): the reward service then gives the batch
      its fallback, counted. An item the server could not score comes back as
      ``{"reward": None, "remote_error": why}``, which the service counts as that trajectory's
      failure.
    - Circuit breaker (``resilience.Breaker``): after ``breaker_failures`` failed calls in a row
      the server is open for ``breaker_cooldown_s``: calls raise ``RemoteBreakerOpen`` at once
      (no network); then one trial call decides. ``stats()`` counts requests, items, retries and
      failures by kind.
    """

    def __init__(self, url: str, timeout_s: float = 4.0, retries: int = 2, backoff_s: float = 0.1,
                 max_batch: int = 64, breaker_failures: int = 5, breaker_cooldown_s: float = 10.0,
                 health_timeout_s: float = 10.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise RewardError(f"reward.fn={url!r}: give the server as http://host:port (conveyor serve-reward)")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise RewardError(f"reward.fn={url!r}: the port is not a number; give http://host:port") from None
        numbers_ok = all(math.isfinite(v) and v > 0 for v in (timeout_s, breaker_cooldown_s, health_timeout_s))
        if not numbers_ok or retries < 0 or backoff_s < 0 or max_batch < 1 or breaker_failures < 1:
            raise RewardError(f"reward {url}: timeout_s, breaker_cooldown_s and health_timeout_s must be > 0, "
                              "retries and backoff_s >= 0, max_batch and breaker_failures >= 1 (reward.kwargs)")
        self.url, self.host, self.port = url.rstrip("/"), parts.hostname, port
        self._https, self._base = parts.scheme == "https", parts.path.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), int(retries), float(backoff_s)
        self.breaker = Breaker(breaker_failures, breaker_cooldown_s, label="remote reward")
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._counts = {k: 0 for k in ("requests", "items", "retries", "item_errors", "timeout", "unreachable",
                                       "server_error", "rejected", "bad_response", "breaker_open")}
        health = self._health(float(health_timeout_s))
        self.name = f"remote {health.get('reward', '?')}"
        server_batch = health.get("max_batch")
        self.max_batch = min(int(max_batch), server_batch if isinstance(server_batch, int) and server_batch > 0
                             else int(max_batch))

    # ----- the reward --------------------------------------------------------------------
    def score_batch(self, trajs: Sequence[Trajectory]) -> list[float | dict]:
        out: list[float | dict] = []
        for start in range(0, len(trajs), self.max_batch):
            chunk = trajs[start:start + self.max_batch]
            out += self._score_chunk([WireTrajectory.of(t).to_json() for t in chunk])
        return out

    def __call__(self, traj: Trajectory) -> float | dict:
        return self.score_batch([traj])[0]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Nothing is held between calls (one connection per request)."""

    # ----- one request -------------------------------------------------------------------
    def _score_chunk(self, items: list[dict]) -> list[float | dict]:
        if not self.breaker.allow(self.url):
            self._count("breaker_open")
            raise RemoteBreakerOpen(f"reward server {self.url} failed {self.breaker.failures} calls in a row; "
                                    f"calls fail fast for {self.breaker.cooldown_s:g}s, then one trial call")
        try:
            body = json.dumps({"version": WIRE_VERSION, "items": items}, allow_nan=False).encode()
        except (TypeError, ValueError) as e:  # task.info that JSON cannot carry: this client's data, not the server
            self._count("rejected")
            raise RemoteRejected(f"a trajectory cannot be sent to {self.url} ({e}); task.info must be JSON") from None
        self._count("requests")
        self._count("items", len(items))
        try:
            results = self._post(body, len(items))
        except RemoteRewardFailure as e:
            self._count(e.kind)
            self.breaker.record(self.url, False)
            raise
        self.breaker.record(self.url, True)
        return results

    def _post(self, body: bytes, n: int) -> list[float | dict]:
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(self.retries + 1):
            try:
                status, data = self._request("POST", "/v1/score", body, deadline)
            except _Retryable as e:
                delay = backoff_delay(attempt, self.backoff_s, self.timeout_s, self._rng)
                if attempt == self.retries or time.monotonic() + delay >= deadline:
                    raise e.final(f"reward server {self.url}: {e} (after {attempt + 1} attempts)") from None
                self._count("retries")
                time.sleep(delay)
                continue
            if 400 <= status < 500:
                raise RemoteRejected(f"reward server {self.url} refused the request (HTTP {status}): "
                                     f"{data[:300].decode('utf-8', 'replace')}")
            return self._results(status, data, n)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _results(self, status: int, data: bytes, n: int) -> list[float | dict]:
        def bad(why: str) -> RemoteBadResponse:
            return RemoteBadResponse(f"reward server {self.url} answered HTTP {status} with {why}")
        try:
            doc = json.loads(data)
        except ValueError:
            raise bad(f"something that is not JSON: {data[:80]!r}") from None
        if status != 200 or not isinstance(doc, dict):
            raise bad(f"{str(doc)[:200]}")
        if doc.get("version") != WIRE_VERSION:
            raise bad(f"wire version {doc.get('version')!r}, this client speaks {WIRE_VERSION}")
        results = doc.get("results")
        if not isinstance(results, list) or len(results) != n:
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise bad(f"{got} results for {n} items")
        out: list[float | dict] = []
        for r in results:
            if isinstance(r, dict) and isinstance(r.get("error"), str):
                self._count("item_errors")
                out.append({"reward": None, "remote_error": r["error"][:300]})
            elif (isinstance(r, dict) and isinstance(r.get("reward"), (int, float))
                  and not isinstance(r["reward"], bool) and isinstance(r.get("info", {}), dict)):
                out.append({**r.get("info", {}), "reward": float(r["reward"])})
            else:
                raise bad(f"a result that is neither a reward nor an error: {str(r)[:120]}")
        return out

    def _health(self, timeout_s: float) -> dict:
        deadline, last = time.monotonic() + timeout_s, "no attempt"
        while True:
            try:
                status, data = self._request("GET", "/health", None, min(deadline, time.monotonic() + 5.0))
                doc = json.loads(data) if status == 200 else None
                if isinstance(doc, dict) and doc.get("status") == "ok":
                    if doc.get("version") != WIRE_VERSION:
                        raise RewardError(f"reward server {self.url} speaks wire version {doc.get('version')!r}, "
                                          f"this client {WIRE_VERSION}: run the same conveyor version on both sides")
                    return doc
                last = f"HTTP {status}: {data[:120]!r}"
            except (_Retryable, RemoteRewardFailure, ValueError) as e:
                last = str(e)
            if time.monotonic() + 0.2 >= deadline:
                raise RewardError(f"reward server {self.url} did not answer GET /health within {timeout_s:g}s "
                                  f"({last}); start it with `conveyor serve-reward SPEC --port PORT` or fix reward.fn")
            time.sleep(0.2)

    def _request(self, method: str, path: str, body: bytes | None, deadline: float) -> tuple[int, bytes]:
        """One HTTP exchange that ends by ``deadline`` (every socket wait gets the time left)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise RemoteTimeout(f"reward server {self.url}: no time left for {method} {path}")
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=left)
        try:
            conn.request(method, self._base + path, body=body,
                         headers={"Content-Type": "application/json", "Accept": "application/json"})
            sock = conn.sock  # the connection lets go of it once a response says it will close
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            resp = conn.getresponse()
            chunks, size = [], 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout()
                sock.settimeout(left)
                chunk = resp.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_BODY:
                    raise RemoteBadResponse(f"reward server {self.url}: an answer over {MAX_BODY} bytes")
                chunks.append(chunk)
            if resp.status >= 500:
                raise _Retryable(f"HTTP {resp.status}: {b''.join(chunks)[:200].decode('utf-8', 'replace')}",
                                 RemoteServerError)
            return resp.status, b"".join(chunks)
        except (socket.timeout, TimeoutError):
            raise RemoteTimeout(f"reward server {self.url}: no answer to {method} {path} before the "
                                f"deadline (reward.kwargs.timeout_s={self.timeout_s:g})") from None
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        finally:
            conn.close()

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n
