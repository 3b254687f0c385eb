"""8-bit rollouts (``rollout.quantization``): the per-channel round trip within what e4m3 and
int8 allow, the 8-bit GEMMs against the products they stand for, the fast runner with fp8 and
int8 weights against a Hugging Face model that computes exactly what they should (fake-quantised
weights, and for fp8 activations) and against the unquantised model (close, and not equal),
re-quantisation on a weight update, the refusals, and the truncated importance-sampling default.
Every test runs on the CPU (torch's own fp8 GEMM and int8 kernels)."""
from __future__ import annotations

import copy

import pytest
import torch

from conveyor.config import RunConfig
from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.native.quant import (
    FP8,
    QuantWeight,
    dequantize,
    error_bound,
    quantize,
)

TEXTS = ["a", "hi there", "The quick brown fox", "1+2=", "hello, world! how are you?"]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       seed=0).eval()


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows over four decades
    w[0] = 0.0  # an all-zero row must not divide by zero
    w[1, :8] = 1e-9 * w[1, :8]  # values deep in the subnormal range of their row
    return w


# ----- the format ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_round_trip_error_is_within_the_format_bound(kind):
    w = _weights()
    q, scale = quantize(w, kind)
    assert q.dtype == (FP8 if kind == "fp8" else torch.int8) and scale.shape == (48,)
    top = 448.0 if kind == "fp8" else 127.0
    torch.testing.assert_close(scale[1:], w[1:].abs().amax(1) / top)  # per output channel: the row's max
    err = (dequantize(q, scale) - w).abs()
    # the bound, plus float32 rounding of the division and the product
    assert bool((err <= error_bound(w, scale, kind) + 2 * EPS32 * w.abs()).all())
    assert float(err.max()) > 0  # it did quantise
    assert float(dequantize(q, scale)[0].abs().max()) == 0.0


def _product_bound(x, w, kind):
    """|x~ w~ - x w| summed over k, from the per-element bounds of both factors (fp8: both quantised)."""
    _, sw = quantize(w, kind)
    ew = error_bound(w, sw, kind)
    if kind == "int8":
        return x.abs() @ ew.T
    _, sx = quantize(x, "fp8")
    ex = error_bound(x, sx, "fp8")
    return ex @ w.abs().T + x.abs() @ ew.T + ex @ ew.T


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_gemm_is_the_product_it_stands_for(kind, dtype):
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(dtype).float()
    w = _weights(1).to(dtype).float()
    bias = torch.randn(48).to(dtype).float()
    qw = QuantWeight(w.to(dtype), kind)
    y = qw(x.to(dtype), bias.to(dtype)).float() - bias
    exact = x @ w.T
    # The sums run in float32 (64 terms); in bf16 three roundings of 2^-9 each: the int8 kernel's
    # scale, the product's output and the bias added to it.
    unit = 3 * 2.0 ** -9 if dtype == torch.bfloat16 else 64 * EPS32
    bound = _product_bound(x, w, kind) * (1 + unit) + unit * (x.abs() @ w.abs().T + bias.abs())
    assert bool(((y - exact).abs() <= bound).all())
    assert float((y - exact).abs().max()) > 0


def test_fp8_emulation_is_the_scaled_mm_product():
    """CPU builds whose _scaled_mm takes only per-tensor scales multiply the same e4m3 values in
    float32; where the native GEMM runs (this torch), both give one product up to float32 sums."""
    from conveyor.rollout.native.quant import _fp8_linear, fp8_method
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(5))
    qw = QuantWeight(_weights(4), "fp8")
    emulated = _fp8_linear(x, qw.q, qw.scale, torch.float32, native=False)
    assert emulated.shape == (7, 48)
    if fp8_method(qw.q) == "scaled_mm":
        native = _fp8_linear(x, qw.q, qw.scale, torch.float32, native=True)
        mags = (x.abs() @ dequantize(qw.q, qw.scale.reshape(-1)).abs().T) * (1 + 2.0 ** -4)
        assert bool(((native - emulated).abs() <= 2 * 64 * EPS32 * mags).all())
    else:
        assert qw.method == "emulated"


def test_requantize_follows_the_source_in_place():
    w = _weights(3)
    qw = QuantWeight(w, "fp8")
    q_ptr, s_ptr = qw.q.data_ptr(), qw.scale.data_ptr()
    w.mul_(-2.0)
    qw.requantize()
    assert (qw.q.data_ptr(), qw.scale.data_ptr()) == (q_ptr, s_ptr)  # captured graphs keep reading them
    q, scale = quantize(w, "fp8")
    assert torch.equal(qw.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(qw.scale[0], scale)


# ----- the fast runner -----------------------------------------------------------------
def _fake_quantised(model, kind):
    """A Hugging Face copy computing what the 8-bit engine should: its q/k/v/o/gate/up/down
    weights replaced by their dequantised 8-bit values and, for fp8, each of their inputs by
    its per-row e4m3 round trip."""
    ref = copy.deepcopy(model)

    def fake_input(_module, args):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1])
        return (dequantize(*quantize(flat, "fp8")).reshape(x.shape).to(x.dtype),)

    with torch.no_grad():
        for name, module in ref.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                module.weight.copy_(dequantize(*quantize(module.weight, kind)))
                if kind == "fp8":
                    module.register_forward_pre_hook(fake_input)
    return ref


def _scores(model, prompt, completion):
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1), logits


def _engine(model, tok, quantization, **kw):
    return NativeEngine(copy.deepcopy(model), tok, device="cpu", dtype="float32", runner="fast", kv_blocks=64,
                        quantization=quantization, **kw)


def _diffs(engine, refs, prompts, params):
    """|engine logprob - ref logprob| of every sampled token ``[tokens]`` per reference model, and
    the largest |logit| of the first reference."""
    out, top = [[] for _ in refs], 0.0
    for prompt, samples in zip(prompts, engine.generate(prompts, params)):
        for c in samples:
            for i, ref in enumerate(refs):
                lp, logits = _scores(ref, prompt, c.token_ids)
                out[i].append((torch.tensor(c.logprobs) - lp).abs())
                top = max(top, float(logits.abs().max())) if i == 0 else top
    return [torch.cat(d) for d in out], top


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_fast_runner_computes_the_quantised_model(tok, model, kind):
    prompts = [tok.encode(t) for t in TEXTS]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    engine = _engine(model, tok, kind)
    assert kind in engine.label
    (to_fake, to_plain), top = _diffs(engine, [_fake_quantised(model, kind), model], prompts, params)
    # What float32 reorderings leave (the unquantised engine matches Hugging Face to this).
    noise = 64 * EPS32 * max(1.0, top)
    if kind == "int8":
        assert float(to_fake.max()) <= noise
    else:
        # An activation a rounding step apart in the two forwards lands on the other e4m3 value:
        # rare, and far smaller than quantising everything.
        assert float(to_fake.quantile(0.9)) <= noise
        assert float(to_fake.max()) <= 0.1 * float(to_plain.max())
    # Close to the unquantised model: each of the G GEMMs on a token's path is off by the
    # format's relative RMS error eps (weights, and for fp8 activations: a uniform rounding
    # within 2^-4 of the value, 2^-4 / sqrt(3)); summed to first order over the path, the logits
    # move by G * eps of their size and a logprob by twice that. Not equal either: a
    # quantisation that silently did nothing fails here.
    layers = model.config.num_hidden_layers
    eps = _weight_rms_error(model, kind) + (2.0 ** -4 / 3 ** 0.5 if kind == "fp8" else 0.0)
    assert float(to_plain.max()) <= 2 * (4 * layers) * eps * top
    assert float(to_plain.max()) > 100 * noise


def _weight_rms_error(model, kind):
    """RMS of (w - its 8-bit value) over RMS of w, over the quantised weights."""
    err = total = 0.0
    for name, p in model.named_parameters():
        if name.rsplit(".", 2)[-2] in LINEARS:
            w = p.detach().float()
            err += float(((dequantize(*quantize(w, kind)) - w) ** 2).sum())
            total += float((w ** 2).sum())
    return (err / total) ** 0.5


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_weight_update_requantises(tok, model, kind):
    prompts = [tok.encode(t) for t in TEXTS]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8, seed=0)
    engine = _engine(model, tok, kind)
    ptrs = [qw.q.data_ptr() for qw in engine.runner.net.quant_weights]
    assert len(ptrs) == 4 * model.config.num_hidden_layers  # q/k/v, o, gate/up, down per layer
    before = engine.generate(prompts, greedy)
    # Only the quantised weights change: without re-quantisation nothing the engine computes would.
    g = torch.Generator().manual_seed(7)
    new = {name: p.detach() * (1 + 0.5 * torch.randn(p.shape, generator=g))
           for name, p in model.named_parameters() if name.rsplit(".", 2)[-2] in LINEARS}
    names = sorted(new)  # in two buckets, as a bucketed publish sends them: q_proj in one, k_proj in the other
    engine.update_weights({k: new[k] for k in names[::2]}, version=1)
    engine.update_weights({k: new[k] for k in names[1::2]}, version=1)
    after = engine.generate(prompts, greedy)
    assert [c[0].logprobs for c in after] != [c[0].logprobs for c in before]
    assert [qw.q.data_ptr() for qw in engine.runner.net.quant_weights] == ptrs  # in place
    updated = copy.deepcopy(model)
    updated.load_state_dict(new, strict=False)
    fresh = _engine(updated, tok, kind).generate(prompts, greedy)
    assert [c[0].token_ids for c in after] == [c[0].token_ids for c in fresh]
    for a, f in zip(after, fresh):
        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(f[0].logprobs), rtol=0,
                                   atol=64 * EPS32)


# ----- refusals and defaults -----------------------------------------------------------
@pytest.mark.parametrize("rollout, fix", [({"engine": "vllm"}, "rollout.engine=native"),
                                          ({"engine": "remote", "remote_url": "http://h:1"}, "rollout.engine=native"),
                                          ({"runner": "hf"}, "rollout.runner=fast")])
def test_config_refuses_engines_that_cannot_quantise(rollout, fix):
    with pytest.raises(ValueError, match=f"rollout.quantization=fp8 .*{fix}"):
        RunConfig.model_validate({"rollout": {"quantization": "fp8", **rollout}})


def test_engine_refuses_what_it_cannot_quantise(tok, model):
    with pytest.raises(ValueError, match="rollout.quantization=int8 needs the fast runner; set rollout.runner=fast"):
        NativeEngine(copy.deepcopy(model), tok, device="cpu", runner="hf", quantization="int8")
    with pytest.raises(ValueError, match="rollout.quantization 'fp4' is not one of none, fp8, int8"):
        _engine(model, tok, "fp4")
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="needs the fast runner, which cannot run this model .*"
                                         "set rollout.quantization=none"):
        NativeEngine(gpt2, tok, device="cpu", quantization="fp8")
    from conveyor.rollout.native.quant import check_shape
    with pytest.raises(ValueError, match="multiples of 16, got \\(40, 64\\); use rollout.quantization=int8"):
        check_shape(torch.Size([40, 64]), "fp8")


def test_preflight_refuses_fp8_on_a_card_without_fp8(monkeypatch):
    # The card is the part this machine lacks: torch's report of it is what is replaced.
    from conveyor.launch.preflight import DeviceError, check_devices
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cfg = RunConfig.model_validate({"rollout": {"quantization": "fp8"}})
    with pytest.raises(DeviceError, match="rollout.quantization=fp8 but cuda:0: NVIDIA A100-SXM4-80GB \\(compute "
                                          "capability 8.0\\) .* set rollout.quantization=int8"):
        check_devices(cfg, visible_gpus=1)
    check_devices(RunConfig.model_validate({"rollout": {"quantization": "int8"}}), visible_gpus=1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_devices(cfg, visible_gpus=1)


def test_quantised_rollouts_default_to_truncated_importance_sampling():
    assert RunConfig.model_validate({"rollout": {"quantization": "fp8"}}).algo.importance_sampling == "truncated"
    assert RunConfig.model_validate({"rollout": {"quantization": "int8"}}).algo.importance_sampling == "truncated"
    kept = RunConfig.model_validate({"rollout": {"quantization": "fp8"}, "algo": {"importance_sampling": "none"}})
    assert kept.algo.importance_sampling == "none"
    masked = RunConfig.model_validate({"rollout": {"quantization": "int8"}, "algo": {"importance_sampling": "masked"}})
    assert masked.algo.importance_sampling == "masked"
    assert RunConfig.model_validate({}).algo.importance_sampling == "none"


# ----- through the loop --------------------------------------------------------------------
@pytest.mark.slow  # a whole (tiny) training run, ~20 s
def test_rl_steps_with_fp8_rollouts(tmp_path, capsys):
    from conveyor.config import load_config
    from conveyor.observe.report import read_metrics
    from conveyor.run.local import run_local

    over = ["sft.steps=0", "loop.steps=3", "loop.batch_size=4", "rollout.n=4", "data.eval_size=8",
            "loop.eval_every=0", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
            "model.tiny.intermediate_size=64", "observe.tensorboard=false", "observe.progress=false",
            "trainer.lr=1e-3", "rollout.runner=fast", "rollout.quantization=fp8", "rollout.device=cpu",
            "trainer.device=cpu", "launch.timeout_s=120",
            # an entropy term makes every sample count (none inert, trainer/single.py): each step's
            # forward runs and reports its ratios, whatever rewards the untrained model earns
            "algo.entropy_coef=0.001"]
    cfg = load_config(None, over)
    assert cfg.algo.importance_sampling == "truncated"
    run_local(cfg, tmp_path / "run")
    out = capsys.readouterr()
    text = out.out + out.err
    assert "fp8 linear weights" in text and "algo.importance_sampling=truncated (is_cap=2.0" in text
    train = read_metrics(tmp_path / "run", kind="train")
    assert len(train) == 3
    ratios = [m[k] for m in train for k in m if k.endswith("is_ratio_mean")]
    assert len(ratios) == 3 and all(0.5 < r < 2.0 for r in ratios)
    # The trainer's float32 logprobs differ from the fp8 engine's: the ratio is not exactly 1.
    assert any(abs(r - 1.0) > 1e-4 for r in ratios)


@pytest.mark.slow  # a subprocess building three engines, ~15 s on a loaded 2-core CPU
def test_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/quantized_rollout.py at the tiny shape: every quantization decodes, is scored, records."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "quantized_rollout.py"), "--shape", "tiny",
                          "--device", "cpu", "--batches", "4", "--new", "8", "--mismatch-prompts", "2",
                          "--out", str(tmp_path)], check=False, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}",
                              "CONVEYOR_BENCH_RESULTS": str(tmp_path / "results")})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {q: json.loads((tmp_path / f"quantized_rollout_tiny_{q}.json").read_text()) for q in ("none", "fp8", "int8")}
    lines = [json.loads(x) for x in (tmp_path / "results" / "quantized_rollout_cpu.jsonl").read_text().splitlines()]
    assert [x["config"]["quantization"] for x in lines] == ["none", "fp8", "int8"]
    for q, row in rows.items():
        assert row["decode"][0]["tokens"] == 4 * 8 and row["decode"][0]["decode_tok_s"] > 0
        assert row["mismatch"]["tokens"] == 2 * 4 * 8 and row["mismatch"]["ratio_p1"] <= row["mismatch"]["ratio_p99"]
        assert row["gemm"] == {"none": ["bf16"], "fp8": ["scaled_mm"], "int8": ["int8pack"]}[q]
    # 8-bit linear weights: a step reads less than in bf16, and the trainer sees a larger gap
    assert rows["fp8"]["weight_read_bytes"] < rows["none"]["weight_read_bytes"]
    assert rows["fp8"]["mismatch"]["max_abs_logprob_diff"] > rows["none"]["mismatch"]["max_abs_logprob_diff"]
