"""The paged fast runner: block allocator values, greedy and logprob parity with Hugging
Face (Llama, Qwen2, Qwen3 tiny models, fp32), prompt blocks shared by a group,
preemption under a tiny pool, in-place weight updates, memory release, abort, the
logged fallback for unsupported models, and the Triton kernels against the torch
reference (where Triton runs). Every test runs on the CPU; with a GPU the engine
tests run there too (Triton kernels and CUDA graphs)."""
from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys

import pytest
import torch

from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.native.graph_runner import PagedGraphRunner, decode_buckets
from conveyor.rollout.native.paged import BlockAllocator, blocks_for, kv_pool_blocks
from conveyor.rollout.native.scheduler import Request

TEXTS = ["a", "hi there", "The quick brown fox", "1+2=", "zz", "hello, world! how are you?"]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tiny(tok, arch="llama", seed=0, **kw):
    if arch == "qwen3":
        from transformers import AutoModelForCausalLM, Qwen3Config

        cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
                          tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # random, not unit, q/k norm weights so the norms matter
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        return model.eval()
    return build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       arch=arch, seed=seed, **kw).eval()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in TEXTS]


def fast(model, tok, device="cpu", **kw):
    kw.setdefault("kv_blocks", 64)
    return NativeEngine(copy.deepcopy(model), tok, device=device, dtype="float32", runner="fast", **kw)


def hf_greedy(model, prompt, max_new, eos):
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new, pad_token_id=0)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos in out else out


def hf_logprobs(model, prompt, completion, temperature):
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    scaled = logits[len(prompt) - 1:-1] / (temperature or 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


# ----- bookkeeping ---------------------------------------------------------------------
def test_block_allocator_values():
    a = BlockAllocator(6)
    assert (a.capacity, a.num_free) == (5, 5)
    assert a.allocate(2) == [1, 2]  # block 0 is the null block, never handed out
    assert a.allocate(4) is None and a.num_free == 3  # all or nothing
    b = a.allocate(3)
    assert b == [3, 4, 5] and a.num_free == 0
    assert a.share(1) == 1 and a.refcount[1] == 2
    a.free([1, 2])
    assert a.num_free == 1 and a.refcount[1] == 1  # block 1 is still referenced once
    a.free([1])
    assert a.num_free == 2 and a.allocate(1) == [1]  # freed blocks are reused first
    with pytest.raises(ValueError, match="double free"):
        a.free([2])
    with pytest.raises(ValueError, match="not allocated"):
        a.share(2)
    assert blocks_for(16, 16) == 1 and blocks_for(17, 16) == 2 and blocks_for(0, 16) == 0


def test_pool_sizing_and_buckets():
    gpu = dict(device_type="cuda", bytes_per_block=1000, kv_fraction=0.5, kv_blocks=None, workspace_bytes=100_000)
    assert kv_pool_blocks(free_bytes=1_000_000, **gpu) == 400  # (0.5 * 1e6 - 1e5) / 1e3
    assert kv_pool_blocks(**{**gpu, "kv_blocks": 7}) == 7
    assert kv_pool_blocks(**{**gpu, "device_type": "cpu"}) == 256
    with pytest.raises(RuntimeError, match="no GPU memory left.*raise rollout.kv_fraction"):
        kv_pool_blocks(free_bytes=150_000, **gpu)
    assert decode_buckets(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]


# ----- parity --------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_hf_generate(tok, prompts, arch, device):
    model = tiny(tok, arch)
    eng = fast(model, tok, device, max_batch=4)
    assert isinstance(eng.runner, PagedGraphRunner)
    out = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for prompt, (c,) in zip(prompts, out):
        assert c.token_ids == hf_greedy(model, prompt, 12, tok.eos_token_id)
        ref = hf_logprobs(model, prompt, c.token_ids, 0.0)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch,top_k,top_p", [("llama", 20, 0.9), ("qwen2", 20, 0.9), ("qwen2", 0, 1.0)])
def test_sampled_logprobs_match_plain_forward(tok, prompts, arch, top_k, top_p, device):
    # On a GPU, top_k 0 / top_p 1 takes the fused sampler; truncation takes the reference one.
    model = tiny(tok, arch)
    eng = fast(model, tok, device, max_batch=3, refill=1)
    stops = tuple(tok.convert_tokens_to_ids(list("aeiost")))  # ragged lengths: admissions join a running batch
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, n=2, max_new_tokens=14, seed=3,
                            stop_token_ids=stops)
    out = eng.generate(prompts, params)
    worst = max((hf_logprobs(model, p, c.token_ids, 0.7) - torch.tensor(c.logprobs)).abs().max().item()
                for p, g in zip(prompts, out) for c in g)
    assert worst < 1e-5
    again = eng.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in out]


@pytest.mark.parametrize("device", DEVICES)
def test_next_step_is_queued_before_the_one_before_is_read(tok, prompts, device):
    """Each decode step after the first of a batch is queued with the tokens of the step before
    still on the device. A request that ends on a stop token was decoded once more (that
    token is dropped); one that ends by length is not decoded past its budget; every block
    comes back; greedy outputs equal a loop that decodes one request at a time."""
    model = tiny(tok, "qwen2")
    stops = tuple(tok.convert_tokens_to_ids(list("aeiost")))
    eng = fast(model, tok, device, max_batch=4, refill=1)
    real, calls = eng.runner.decode, []

    def decode(running, last=None, src=None, rows=None):
        calls.append((len(running), last is not None, src))
        return real(running, last, src, rows)
    eng.runner.decode = decode
    # Sampled: stop tokens end samples at many different steps, mid-batch.
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=30, stop_token_ids=stops, seed=0)
    out = [c for g in eng.generate(prompts * 2, params) for c in g]
    ahead = [c for c in calls if c[1]]
    assert len(ahead) >= len(calls) // 2 and all(max(src) >= 0 for _, _, src in ahead)
    assert sum(c.finish_reason == "stop" and 1 < len(c.token_ids) < 30 for c in out) >= 3
    for c in out:
        ends = [i for i, t in enumerate(c.token_ids) if t in stops or t in eng.eos_ids]
        assert (c.finish_reason == "stop") == bool(ends) and (not ends or ends[0] == len(c.token_ids) - 1)
        assert c.finish_reason == "stop" or len(c.token_ids) == 30
    assert eng.runner.allocator.num_free == eng.runner.allocator.capacity
    greedy = SamplingParams(temperature=0.0, n=2, max_new_tokens=9, stop_token_ids=stops)
    batched = eng.generate(prompts, greedy)
    alone = [fast(model, tok, device, max_batch=1).generate([p], greedy)[0] for p in prompts]
    assert [[c.token_ids for c in g] for g in batched] == [[c.token_ids for c in g] for g in alone]


# ----- paging --------------------------------------------------------------------------
def test_group_shares_prompt_blocks(tok):
    model = tiny(tok)
    runner = fast(model, tok, block_size=4, kv_blocks=32).runner
    prompt = list(range(10, 20))  # 10 tokens: two full blocks and a partial one
    group = [Request(0, j, prompt, 5) for j in range(3)]
    with torch.inference_mode():
        logits = runner.prefill(group)
    lead, *rest = [r.kv.blocks for r in group]
    assert len(lead) == 3 and all(b[:2] == lead[:2] and b[2] != lead[2] for b in rest)
    assert [runner.allocator.refcount[b] for b in lead] == [3, 3, 1]
    assert runner.allocator.num_free == 31 - 3 - 2  # one prefill, two copied partial blocks
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    pool = runner.kv.view(2, 2, -1, 4, runner.net.nkv, runner.net.head_dim)
    assert torch.equal(pool[:, :, rest[0][2], :2], pool[:, :, lead[2], :2])  # the copied tokens
    for r in group:
        runner.free(r)
    assert runner.allocator.num_free == 31


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_pool_preempts_and_keeps_outputs(tok, prompts, device):
    model = tiny(tok, "qwen2")
    big = fast(model, tok, device, kv_blocks=256)
    small = fast(model, tok, device, block_size=4, kv_blocks=14, max_batch=8)
    preempted = []
    small.runner.ensure_slots = _recording(small.runner.ensure_slots, preempted)
    # Greedy, and sampled: a preempted request is recomputed and draws on from its own stream.
    for params in (SamplingParams(temperature=0.0, n=2, max_new_tokens=20),
                   SamplingParams(temperature=1.0, n=2, max_new_tokens=20, seed=4)):
        ref = big.generate(prompts, params)
        out = small.generate(prompts, params)
        assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in ref]
    assert len(preempted) > 0
    assert small.runner.allocator.num_free == small.runner.allocator.capacity  # everything freed
    with pytest.raises(ValueError, match="prompt 0 needs up to 60 tokens of KV cache but the pool holds 52"):
        small.generate([[5] * 40], SamplingParams(max_new_tokens=20))


def _recording(real, sink):
    def wrapped(running, *rows):
        out = real(running, *rows)
        sink.extend(out)
        return out
    return wrapped


# ----- weights, memory, control ----------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_update_weights_changes_outputs_without_recapture(tok, prompts, device):
    model, other = tiny(tok), tiny(tok, seed=7)
    eng = fast(model, tok, device)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    before = eng.generate(prompts, params)
    fused = eng.runner.net.layers[0].qkv_w
    ptr, graphs = fused.data_ptr(), dict(eng.runner._graphs)
    eng.update_weights(other.state_dict(), version=2)
    after = eng.generate(prompts, params)
    assert fused.data_ptr() == ptr and eng.runner._graphs == graphs
    assert torch.equal(fused[:64].cpu(), other.model.layers[0].self_attn.q_proj.weight)
    for prompt, (c,) in zip(prompts, after):
        assert c.token_ids == hf_greedy(other, prompt, 10, tok.eos_token_id) and c.versions == [2] * len(c.token_ids)
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]


@pytest.mark.parametrize("device", DEVICES)
def test_release_and_reacquire_memory(tok, prompts, device):
    eng = fast(tiny(tok), tok, device)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    before = eng.generate(prompts, params)
    ptr, graphs = eng.runner.kv.data_ptr(), dict(eng.runner._graphs)
    eng.release_memory()
    assert eng.runner.kv is None
    with pytest.raises(RuntimeError, match="call reacquire_memory"):
        eng.generate(prompts, params)
    if device == "cuda":  # the pool's memory is back with the driver, its addresses kept
        assert eng.runner._vmm is not None and not eng.runner._vmm.mapped
    eng.reacquire_memory()
    if device == "cuda":  # same addresses: the graphs captured over the pool are kept, not recaptured
        assert eng.runner.kv.data_ptr() == ptr and eng.runner._graphs == graphs and graphs
    assert [g[0].token_ids for g in eng.generate(prompts, params)] == [g[0].token_ids for g in before]


def test_abort_returns_partial_completions(tok, prompts):
    eng = fast(tiny(tok), tok)
    real, calls = eng.runner.decode, []

    def decode(running, *ahead):
        calls.append(1)
        if len(calls) == 3:
            eng.abort()
        return real(running, *ahead)

    eng.runner.decode = decode
    out = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=50, eos_bias=-1e4, seed=0))
    assert all(c.finish_reason == "abort" and len(c.token_ids) == 4 for g in out for c in g)
    assert eng.runner.allocator.num_free == eng.runner.allocator.capacity


def test_pause_holds_scheduling_until_resume(tok, prompts):
    import threading

    eng = fast(tiny(tok), tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    ref = eng.generate(prompts, params)
    eng.pause()
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("out", eng.generate(prompts, params)))
    worker.start()
    worker.join(timeout=0.3)
    assert worker.is_alive() and "out" not in result  # paused: no step runs
    eng.resume()
    worker.join(timeout=30)
    assert [g[0].token_ids for g in result["out"]] == [g[0].token_ids for g in ref]


def test_unsupported_model_falls_back_to_hf(tok, caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                      eos_token_id=tok.eos_token_id))
    with caplog.at_level(logging.WARNING):
        eng = NativeEngine(gpt2, tok, device="cpu", runner="fast")
    assert not eng.paged and "model_type 'gpt2' is not one of llama, qwen2, qwen3" in caplog.text
    assert len(eng.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0))[0][0].token_ids) <= 3
    assert not NativeEngine(tiny(tok), tok, device="cpu").paged  # "auto" keeps the HF runner on the CPU


# ----- Triton kernels against the torch reference ---------------------------------------
@pytest.fixture
def triton_device(request):
    """"cuda" on a GPU, "cpu" under Triton's CPU interpreter; otherwise (a plain CPU run) the
    test runs again in a child pytest with TRITON_INTERPRET=1, since the interpreter must be
    chosen before triton is imported, and this run only checks that the child passed (None)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=--import-mode=importlib",
                           "-p", "no:cacheprovider", request.node.nodeid],
                          cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    return None


@pytest.mark.slow  # on a CPU each case runs in a child interpreter
@pytest.mark.parametrize("shape", [(3, 4, 2, 16, None), (5, 14, 2, 64, (4, 64)), (2, 12, 2, 128, (2, 32)),
                                   (64, 7, 1, 32, (8, 16))])
def test_triton_decode_attention_matches_reference(shape, monkeypatch, triton_device):
    """Chunks of the context dealt to lanes and merged by their log-sum-exp give plain attention:
    the library's own split (16 lanes of 128 tokens here) and lanes that read up to 5 chunks each."""
    dev = triton_device
    if dev is None:
        return
    from conveyor.rollout.native.kernels import torch_ops, triton_ops

    b, nq, nkv, d, split = shape
    if split is not None:
        monkeypatch.setattr(triton_ops, "attention_split", lambda *_: split)
    gen = torch.Generator().manual_seed(b * d)
    ps, nb = 16, 40
    kc, vc = (torch.randn(nb * ps, nkv, d, generator=gen).to(dev) for _ in range(2))
    ctx = torch.randint(1, 300, (b,), generator=gen).to(dev)
    tables = torch.randint(1, nb, (b, 20), generator=gen).to(torch.int32).to(dev)
    q = torch.randn(b, nq, d, generator=gen).to(dev)
    ref = torch_ops.decode_attention(q, kc, vc, tables, ctx, 0.125, ps, int(ctx.max()))
    out = triton_ops.decode_attention(q, kc, vc, tables, ctx, 0.125, ps)
    assert (out - ref).abs().max().item() < 1e-4


@pytest.mark.slow
def test_triton_pointwise_kernels_match_reference(triton_device):
    dev = triton_device
    if dev is None:
        return
    from conveyor.rollout.native.kernels import torch_ops, triton_ops

    gen = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(*s, generator=gen).to(dev) for s in [(5, 96), (5, 96), (96,)])
    (a, ra), (b, rb) = torch_ops.add_rmsnorm(x, r.clone(), w, 1e-6), triton_ops.add_rmsnorm(x, r.clone(), w, 1e-6)
    assert (a - b).abs().max().item() < 1e-5 and (ra - rb).abs().max().item() == 0
    nq, nkv, d, t, s = 4, 2, 16, 7, 64
    qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=gen).to(dev)
    pos, slots = torch.randint(0, 30, (t,), generator=gen).to(dev), torch.randperm(s, generator=gen)[:t].to(dev)
    cos, sin = (torch.randn(40, d, generator=gen).to(dev) for _ in range(2))
    caches = [torch.zeros(s, nkv, d, device=dev) for _ in range(4)]
    q1 = torch_ops.rope_store(qkv, pos, slots, cos, sin, caches[0], caches[1], nq, nkv)
    q2 = triton_ops.rope_store(qkv, pos, slots, cos, sin, caches[2], caches[3], nq, nkv)
    assert (q1 - q2).abs().max().item() < 1e-5
    assert torch.allclose(caches[0], caches[2], atol=1e-5) and torch.equal(caches[1], caches[3])
    gu = torch.randn(3, 3000, generator=gen).to(dev)
    assert (torch_ops.silu_mul(gu) - triton_ops.silu_mul(gu)).abs().max().item() < 1e-5


@pytest.mark.slow
def test_triton_fused_sampler_matches_reference(triton_device):
    dev = triton_device
    if dev is None:
        return
    from conveyor.rollout.native.kernels import triton_ops
    from conveyor.rollout.native.sampling import draw_seeds, request_key, sample

    def seeds(n):
        return torch.from_numpy(draw_seeds([request_key(3, i, 0) for i in range(n)], [0] * n)).to(dev)

    logits = (torch.randn(6, 5000, generator=torch.Generator().manual_seed(1)) * 3).to(dev)
    eos = torch.tensor([7, 11], device=dev)
    for bias in (0.0, 5.0):  # greedy: the same tokens and logprobs as the reference sampler
        t1, l1 = triton_ops.sample_plain(logits, temperature=0.0, eos_ids=eos, eos_bias=bias)
        t2, l2 = sample(logits, temperature=0.0, eos_ids=(7, 11), eos_bias=bias)
        assert torch.equal(t1, t2) and (l1 - l2).abs().max().item() < 1e-5
    # Sampled: the same random numbers as the reference sampler, so the same tokens.
    tokens, lps = triton_ops.sample_plain(logits, temperature=0.7, eos_ids=eos, eos_bias=2.0, seeds=seeds(6))
    ref_tokens, ref_lps = sample(logits, temperature=0.7, eos_ids=(7, 11), eos_bias=2.0, seeds=seeds(6))
    assert torch.equal(tokens, ref_tokens) and (ref_lps - lps).abs().max().item() < 1e-5
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    flat = torch.log(probs).repeat(4000, 1).to(dev)
    drawn, _ = triton_ops.sample_plain(flat, temperature=1.0, eos_ids=eos, eos_bias=0.0, seeds=seeds(4000))
    freq = torch.bincount(drawn.cpu(), minlength=4) / 4000
    assert (freq - probs).abs().max().item() < 0.03
    assert torch.equal(drawn, sample(flat, temperature=1.0, seeds=seeds(4000))[0])
