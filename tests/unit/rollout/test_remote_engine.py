"""RemoteEngine's HTTP behaviour without vLLM: server down, retries, errors, deadlines.

A standard-library HTTP server on loopback plays an OpenAI-compatible server whose
answers the test scripts (503 bursts, 404s, a stall, a canned completion in vLLM's
format); the real vLLM server is exercised in tests/e2e/test_vllm_server.py.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conveyor.rollout.api import SamplingParams
from conveyor.rollout.remote import RemoteEngine, RemoteEngineError

CHOICE = {"index": 0, "text": "ab", "finish_reason": "stop", "token_ids": [7, 2],
          "logprobs": {"tokens": ["token_id:7", "token_id:2"], "token_logprobs": [-1.5, -0.25]}}


class Script:
    def __init__(self):
        self.fail_next = 0        # completions answered 503 before a real answer
        self.stall_s = 0.0        # completions answered only after this long
        self.choice = dict(CHOICE)
        self.bodies: list[dict] = []


def serve(script: Script):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status, payload):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {})
            if self.path == "/v1/models":
                return self._send(200, {"data": [{"id": "tiny", "max_model_len": 64}]})
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"{}")
            if self.path != "/v1/completions":
                return self._send(404, {"detail": "Not Found"})
            script.bodies.append(body)
            if script.fail_next:
                script.fail_next -= 1
                return self._send(503, {"error": "warming up"})
            time.sleep(script.stall_s)
            self._send(200, {"choices": [dict(script.choice, index=i) for i in range(body["n"])]})

    class Server(ThreadingHTTPServer):
        block_on_close = False  # a stalled handler must not hold up teardown

        def handle_error(self, request, client_address):
            pass  # the stall test's client hangs up on purpose; its broken pipe is expected

    httpd = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def script():
    return Script()


@pytest.fixture
def url(script):
    httpd = serve(script)
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_down_is_a_named_error_within_the_deadline():
    t0 = time.monotonic()
    with pytest.raises(RemoteEngineError, match=r"no healthy server at http://127\.0\.0\.1:\d+ .*within 1s"):
        RemoteEngine(f"http://127.0.0.1:{free_port()}", ready_timeout_s=1)
    assert time.monotonic() - t0 < 20  # no-hang bound: its 1 s deadline idle (the default is 30 s)


def test_request_body_and_parsed_completion(url, script):
    eng = RemoteEngine(url, eos_ids=[2])
    assert (eng.model, eng.context_limit) == ("tiny", 64)
    out = eng.generate([[1, 5, 6]], SamplingParams(temperature=0.5, n=2, top_k=0, max_new_tokens=100, seed=9,
                                                   stop_strings=("x",), eos_bias=1.5))
    assert [[c.token_ids for c in g] for g in out] == [[[7, 2], [7, 2]]]
    assert out[0][0].logprobs == [-1.5, -0.25] and out[0][0].versions == [0, 0]
    assert out[0][0].finish_reason == "stop" and out[0][0].text == "ab"
    body = script.bodies[0]
    # seed: (call seed + prompt index) * n, as vLLM gives child j the seed + j
    assert body["prompt"] == [1, 5, 6] and body["n"] == 2 and body["top_k"] == -1 and body["seed"] == 18
    assert body["max_tokens"] == 61  # capped by the context: 64 - 3 prompt tokens
    assert body["stop"] == ["x"] and body["include_stop_str_in_output"] is True
    assert body["stop_token_ids"] == [2] and body["logit_bias"] == {"2": 1.5}
    greedy = eng.generate([[1]], SamplingParams(temperature=0, n=3))
    assert len(greedy[0]) == 3 and script.bodies[-1]["n"] == 1  # one greedy sample, copied
    eng.close()


def test_unavailable_answers_are_retried_then_named(url, script):
    eng = RemoteEngine(url, retries=2, backoff_s=0.01)
    script.fail_next = 2
    assert eng.generate([[1]], SamplingParams(n=1))[0][0].token_ids == [7, 2]
    script.fail_next = 3
    with pytest.raises(RemoteEngineError, match="answered HTTP 503"):
        eng.generate([[1]], SamplingParams(n=1))


def test_stalled_request_hits_its_deadline(url, script):
    eng = RemoteEngine(url, request_timeout_s=0.5)
    script.stall_s = 60.0
    t0 = time.monotonic()
    with pytest.raises(RemoteEngineError, match="no answer within 0.5s"):
        eng.generate([[1]], SamplingParams(n=1))
    assert time.monotonic() - t0 < 30  # its deadline, not the stall (a loaded machine adds seconds, not 60)


def test_misaligned_token_ids_and_missing_dev_mode_are_named(url, script):
    eng = RemoteEngine(url, weight_sync="vllm_reload")
    script.choice = dict(CHOICE, token_ids=None, logprobs={"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0]})
    with pytest.raises(RemoteEngineError, match="return_token_ids or return_tokens_as_token_ids"):
        eng.generate([[1]], SamplingParams(n=1))
    import torch
    with pytest.raises(RemoteEngineError, match="VLLM_SERVER_DEV_MODE=1"):
        eng.update_weights({"w": torch.zeros(2)}, version=1)
    assert eng.version == 0
    eng.close()
