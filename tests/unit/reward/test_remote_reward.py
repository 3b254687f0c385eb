"""Remote rewards over real HTTP on loopback: the server (in a thread, or `conveyor serve-reward` in a
subprocess) and the client, its deadline, retries, circuit breaker and the counted fallbacks."""
from __future__ import annotations

import asyncio
import http.server
import json
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conveyor.resilience import backoff_delay
from conveyor.reward.api import RewardError, load_reward
from conveyor.reward.remote import (WIRE_VERSION, RemoteBadResponse, RemoteBreakerOpen, RemoteReward,
                                    RemoteServerError, RemoteTimeout, WireTrajectory)
from conveyor.reward.remote_server import RewardServer, ServeSettings
from conveyor.reward.service import RewardService
from conveyor.reward.verifiers import math_reward
from conveyor.types import Task, Trajectory, TurnRecord

SLACK_S = 20.0  # a loaded 2-core machine: bounds are "no hang", not speed


def traj(i: int, text: str, answer: str = "42") -> Trajectory:
    return Trajectory(Task(f"t{i}", f"question {i}", answer, {"k": [1, "x"]}), (1, 2, 3), (5, 6), (-0.5, -0.1),
                      (0, 0), (1, 1), text=text)


class Recording:
    """A batched reward that records the size of every call."""
    name, max_batch = "recording", 64

    def __init__(self) -> None:
        self.calls: list[int] = []

    def score_batch(self, trajs):
        self.calls.append(len(trajs))
        return [{"reward": len(t.text) / 10, "batch": float(len(trajs))} for t in trajs]

    def close(self) -> None:
        pass


def sleepy(t: Trajectory) -> float:
    time.sleep(3.0)
    return 1.0


def picky(t: Trajectory) -> float:
    if "bad" in t.text:
        raise KeyError("bad")
    return float(len(t.text))


class ServerThread:
    """A RewardServer on its own event loop in a thread, on a free loopback port."""

    def __init__(self, reward, **settings) -> None:
        self.server = RewardServer(reward, ServeSettings(**settings))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_cli(args: list[str], timeout_s: float = 90.0) -> tuple[subprocess.Popen, str]:
    """`conveyor serve-reward ARGS` in a subprocess; returns it and the URL it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "serve-reward", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        if sel.select(max(0.0, deadline - time.monotonic())):
            line = proc.stdout.readline()
            seen.append(line)
            if " at http://" in line:
                return proc, line.split(" at ", 1)[1].split()[0]
            if not line and proc.poll() is not None:
                break
    proc.kill()
    proc.wait(10)
    raise AssertionError(f"serve-reward did not start: {''.join(seen)}")


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    proc.wait(30)
    proc.stdout.close()


def test_wire_round_trip_keeps_what_a_reward_reads():
    t = Trajectory(Task("a", "p", None, {"tests": ["assert 1"]}), (1, 2, 3), (4, 5), (-1.0, 0.0), (3, -1), (1, 0),
                   text="out", finish_reason="length", reward_info={"agent_score": 2.0, "note": "x"},
                   turns=2, turn_records=(TurnRecord(0, 1, 0.5, ("calc",), 0.1, ""), TurnRecord(1, 2, 1.0)))
    wire = WireTrajectory.from_json(json.loads(json.dumps(WireTrajectory.of(t).to_json())))
    back = wire.trajectory()
    assert back.task == t.task and back.text == "out" and back.finish_reason == "length"
    assert (len(back.prompt_ids), len(back.completion_ids), back.num_tokens) == (3, 2, 5)
    assert back.turn_records == t.turn_records and back.env_return == 1.5 and back.turns == 2
    assert dict(back.reward_info) == {"agent_score": 2.0}  # numbers an episode gave; text stays home


def test_scores_equal_the_local_reward():
    trajs = [traj(i, text) for i, text in enumerate(["\\boxed{42}", "it is 41", "42", "no number", "\\boxed{6*7}"])]
    with RewardService(math_reward, timeout_s=20.0, workers=2) as local:
        want = [(t.reward, dict(t.reward_info)) for t in local.score(trajs)]
    with ServerThread(math_reward, batch_wait_ms=5) as srv:
        remote = load_reward(srv.url)
        assert isinstance(remote, RemoteReward) and remote.name == "remote math_reward"
        with RewardService(remote, timeout_s=20.0, workers=2, batch_wait_s=0.05) as svc:
            got = [(t.reward, dict(t.reward_info)) for t in svc.score(trajs)]
            assert svc.stats()["failures"] == 0
    assert got == want and [r for r, _ in got] == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_code_reward_served_equals_local():
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
    trajs = [Trajectory(Task(f"c{i}", "q", None, {"tests": tests}), (1,), (2,), (0.0,), (0,), (1,), text=text)
             for i, text in enumerate(["def add(a, b):\n    return a + b", "def add(a, b):\n    return abs(a) + b",
                                       "def add(a, b) return"])]
    local = load_reward("code")
    want = [local(t) for t in trajs]
    with ServerThread(load_reward("code")) as srv:
        got = load_reward(srv.url).score_batch(trajs)
    assert got == want and [g["results"] for g in got] == ["PP", "PF", "SS"]


def test_batching_batches_requests_from_many_clients():
    rec = Recording()
    with ServerThread(rec, max_batch=8, batch_wait_ms=5000) as srv:
        client = RemoteReward(srv.url)
        with ThreadPoolExecutor(8) as pool:  # eight callers, one trajectory each
            outs = list(pool.map(lambda i: client.score_batch([traj(i, "x" * i)])[0], range(8)))
        assert rec.calls == [8]  # one call: the batch filled before the (long) wait ran out
        assert [o["reward"] for o in outs] == [i / 10 for i in range(8)] and {o["batch"] for o in outs} == {8.0}
        t0 = time.monotonic()
        with ServerThread(rec, max_batch=8, batch_wait_ms=300) as srv2:
            RemoteReward(srv2.url).score_batch([traj(i, "y") for i in range(3)])
        assert rec.calls == [8, 3] and time.monotonic() - t0 >= 0.3  # a partial batch after the wait
        stats = json.loads(urllib.request.urlopen(srv.url + "/stats", timeout=10).read())
    assert stats["requests"] == 8 and stats["items"] == 8 and stats["batches"] == 1 and stats["largest_batch"] == 8


def test_plain_reward_items_share_batches_and_bad_items_fail_alone():
    with ServerThread(picky, max_batch=16, batch_wait_ms=200) as srv:
        client = RemoteReward(srv.url)
        with RewardService(client, timeout_s=20.0, fallback=-1.0, workers=1, batch_wait_s=0.2) as svc:
            outs = svc.score([traj(i, text) for i, text in enumerate(["ab", "bad", "abcd"])])
            stats = svc.stats()
        server = json.loads(urllib.request.urlopen(srv.url + "/stats", timeout=10).read())
    assert [o.reward for o in outs] == [2.0, -1.0, 4.0]
    assert outs[1].reward_info["remote_error"] == "raised KeyError: 'bad'"
    assert stats["failures"] == 1 and client.stats()["item_errors"] == 1
    assert server["calls"] == 3 and server["batches"] == 1  # three reward calls, one batch


def test_slow_server_hits_the_client_deadline_and_falls_back():
    with ServerThread(sleepy, workers=2, timeout_s=30) as srv:
        client = RemoteReward(srv.url, timeout_s=0.5, retries=2)
        t0 = time.monotonic()
        with pytest.raises(RemoteTimeout, match="deadline"):
            client.score_batch([traj(0, "x")])
        assert time.monotonic() - t0 < 0.5 + SLACK_S
        with RewardService(client, timeout_s=5.0, fallback=-2.0, workers=1) as svc:
            [out] = svc.score([traj(1, "x")])
            assert svc.stats()["failures"] == 1 and svc.stats()["timeouts"] == 0  # the client's deadline came first
        assert out.reward == -2.0 and out.reward_info["reward_error"] == "raised RemoteTimeout"
        assert client.stats()["timeout"] == 2 and client.stats()["retries"] == 0  # a timeout is not retried


def test_server_down_at_start_is_a_named_error_before_the_run():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    t0 = time.monotonic()
    with pytest.raises(RewardError) as e:
        load_reward(f"http://127.0.0.1:{port}", {"health_timeout_s": 0.5})
    msg = str(e.value)
    assert "did not answer GET /health within 0.5s" in msg and "conveyor serve-reward" in msg and "\n" not in msg
    assert time.monotonic() - t0 < 0.5 + SLACK_S
    for bad in ("http://", "http://host:port", "http://h:1/?q=1"):
        with pytest.raises(RewardError, match="http://host:port"):
            RemoteReward(bad)


class Garbage(http.server.BaseHTTPRequestHandler):
    """Answers /health properly and /v1/score with whatever the test put in ``answers``."""
    answers: list[tuple[int, bytes]] = []

    def do_GET(self):
        self._send(200, json.dumps({"status": "ok", "version": WIRE_VERSION, "reward": "garbage",
                                    "max_batch": 4}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(*self.answers.pop(0))

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_garbage_answers_are_counted_not_trusted():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = RemoteReward(f"http://127.0.0.1:{httpd.server_address[1]}", retries=1, backoff_s=0.01,
                              breaker_failures=100)
        assert client.max_batch == 4  # the server's bound wins
        ok = json.dumps({"version": WIRE_VERSION, "results": [{"reward": 1.0}]}).encode()
        Garbage.answers[:] = [(200, b"<html>not json"), (200, b'{"version": 99, "results": []}'),
                              (200, json.dumps({"version": WIRE_VERSION, "results": []}).encode()),
                              (200, json.dumps({"version": WIRE_VERSION, "results": ["1.0"]}).encode()),
                              (500, b"boom"), (500, b"boom"), (503, b"busy"), (200, ok)]
        for what in ("not JSON", "wire version 99", "0 results for 1", "neither a reward nor an error"):
            with pytest.raises(RemoteBadResponse, match=what):
                client.score_batch([traj(0, "x")])
        with pytest.raises(RemoteServerError, match="HTTP 500"):
            client.score_batch([traj(0, "x")])  # 5xx is retried (once here), then counted
        assert client.score_batch([traj(0, "x")]) == [{"reward": 1.0}]  # a 503, then a good answer on the retry
        assert {k: v for k, v in client.stats().items() if v} == {
            "requests": 6, "items": 6, "retries": 2, "bad_response": 4, "server_error": 1}
    finally:
        httpd.shutdown()
        httpd.server_close()


class OtherVersion(Garbage):
    def do_GET(self):
        self._send(200, json.dumps({"status": "ok", "version": WIRE_VERSION + 1, "reward": "x"}).encode())


def test_a_server_of_another_wire_version_is_refused_at_start():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OtherVersion)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(RewardError, match=f"speaks wire version {WIRE_VERSION + 1}, this client {WIRE_VERSION}"):
            load_reward(f"http://127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_bad_requests_are_refused_with_the_field_named():
    with ServerThread(math_reward) as srv:
        def post(doc) -> tuple[int, dict]:
            req = urllib.request.Request(srv.url + "/v1/score", data=doc if isinstance(doc, bytes) else
                                         json.dumps(doc).encode(), method="POST")
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())
        item = WireTrajectory.of(traj(0, "42")).to_json()
        assert post(b"{nope")[0] == 400
        assert post({"version": 2, "items": [item]}) == (400, {"error": "wire version 2; this server speaks 1"})
        status, body = post({"version": WIRE_VERSION, "items": [item, {**item, "prompt_tokens": "3"}]})
        assert status == 400 and body["error"] == "items[1].prompt_tokens must be a int, got str"
        assert post({"version": WIRE_VERSION, "items": [item]}) == (
            200, {"version": WIRE_VERSION, "results": [{"reward": 1.0, "info": {"parsed": 1.0}}]})


def test_killed_server_opens_the_breaker_and_it_closes_when_the_server_is_back():
    proc, url = start_cli(["math", "--port", "0", "--batch-wait-ms", "1"])
    port = url.rsplit(":", 1)[1]
    try:
        # timeout_s: a fresh server's first call loads the verifier (seconds on a busy machine);
        # the calls to a dead server are refused at once, whatever the deadline.
        client = load_reward(url, {"timeout_s": 30.0, "retries": 1, "backoff_s": 0.01, "breaker_failures": 2,
                                   "breaker_cooldown_s": 1.0})
        assert client.score_batch([traj(0, "\\boxed{42}")]) == [{"reward": 1.0, "parsed": 1.0}]
        stop(proc, signal.SIGKILL)  # the server dies mid-run
        with RewardService(client, timeout_s=5.0, fallback=-1.0, workers=1) as svc:
            outs = [svc.score([traj(i, "42")])[0] for i in range(4)]  # four calls, one after another
            assert svc.stats()["failures"] == 4 and svc.stats()["scored"] == 4
        assert [o.reward for o in outs] == [-1.0] * 4
        assert [o.reward_info["reward_error"] for o in outs] == ["raised RemoteUnreachable"] * 2 + \
            ["raised RemoteBreakerOpen"] * 2  # two failures in a row open it; then calls fail fast
        assert client.stats()["unreachable"] == 2 and client.stats()["breaker_open"] == 2
        with pytest.raises(RemoteBreakerOpen):
            client.score_batch([traj(9, "42")])
        assert client.stats()["unreachable"] == 2 and client.stats()["breaker_open"] == 3  # no network while open
        proc, url2 = start_cli(["math", "--port", port, "--batch-wait-ms", "1"])  # back on the same port
        assert url2 == url
        deadline = time.monotonic() + 60.0
        while True:  # the cooldown ends; the trial call succeeds and closes the breaker
            try:
                assert client.score_batch([traj(0, "\\boxed{42}")]) == [{"reward": 1.0, "parsed": 1.0}]
                break
            except RemoteBreakerOpen:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert client.breaker.open_keys() == [] and client.score_batch([traj(1, "41")])[0]["reward"] == 0.0
    finally:
        stop(proc)


def test_cli_refuses_bad_arguments_in_one_line():
    r = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve-reward", "math", "--kwargs", "{nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("conveyor: error: --kwargs '{nope' is not JSON")
    r = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve-reward", "nope_reward"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "reward 'nope_reward' is not a builtin" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_backoff_is_exponential_with_full_jitter():
    rng = random.Random(0)
    for attempt, bound in ((0, 0.1), (1, 0.2), (3, 0.8), (10, 1.0)):
        draws = [backoff_delay(attempt, 0.1, 1.0, rng) for _ in range(200)]
        assert all(0.0 <= d <= bound for d in draws) and max(draws) > 0.8 * bound and min(draws) < 0.2 * bound
