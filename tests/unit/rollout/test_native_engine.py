"""NativeEngine on CPU fp32 with a tiny random Llama: logprob parity with a plain HF
forward, greedy parity with ``model.generate``, group sampling, stop rules, weight
updates, EOS bias and scheduling with more requests than batch slots; continuous batching
(``generate_stream`` on the fast runner): chunks joining a running batch, per-chunk reports,
prompt indices across chunks, seeding, validation and abort."""
from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch

from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.rollout.api import Completion, RolloutEngine, SamplingParams, StreamChunk
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.native.sampling import draw_seeds, request_key, sample

TEXTS = ["a", "hi there", "The quick brown fox", "1+2=", "zz", "hello, world! how are you?"]


def tiny(tok, seed=0, **kw):
    return build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=128, seed=seed, **kw)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny(tok).eval()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in TEXTS]


def engine(model, tok, **kw):
    # The engine owns (and may move) its module; tests keep the reference untouched.
    return NativeEngine(copy.deepcopy(model), tok, device="cpu", dtype="float32", **kw)


def hf_logprobs(model, prompt, completion, temperature):
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    scaled = logits[len(prompt) - 1:-1] / (temperature or 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def hf_greedy(model, prompt, max_new, eos):
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new, pad_token_id=0)[0, len(prompt):].tolist()
    return out[:out.index(eos) + 1] if eos in out else out


def frequent_stops(tok):
    # Common characters as stop tokens make lengths vary, so rows finish at different
    # steps and waiting requests are merged into a batch that is still running.
    return tuple(tok.convert_tokens_to_ids(list("aeiost")))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 20, 0.9)])
def test_logprobs_match_plain_forward(model, tok, prompts, temperature, top_k, top_p):
    # Truncation only restricts which tokens are drawn; the logprob stays log_softmax(logits / T).
    eng = engine(model, tok, max_batch=3, refill=1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, n=2, max_new_tokens=14,
                            seed=3, stop_token_ids=frequent_stops(tok))
    merges = []
    real = eng.runner.merge
    eng.runner.merge = lambda a, b: merges.append((a.size, b.size)) or real(a, b)
    out = eng.generate(prompts, params)
    assert any(running > 0 for running, _ in merges), "admissions should join a running batch"
    worst = 0.0
    for prompt, group in zip(prompts, out):
        for c in group:
            ref = hf_logprobs(model, prompt, c.token_ids, temperature)
            worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert worst < 1e-5


def test_greedy_equals_hf_generate(model, tok, prompts):
    eng = engine(model, tok, max_batch=4)
    out = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for prompt, (c,) in zip(prompts, out):
        assert c.token_ids == hf_greedy(model, prompt, 12, tok.eos_token_id)
        ref = hf_logprobs(model, prompt, c.token_ids, 0.0)
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() < 1e-5


def test_group_sampling_shape_diversity_and_seed(model, tok, prompts):
    eng = engine(model, tok)
    params = SamplingParams(temperature=1.0, n=4, max_new_tokens=8, seed=11)
    out = eng.generate(prompts[:3], params)
    assert [len(g) for g in out] == [4, 4, 4]
    for g in out:
        assert all(isinstance(c, Completion) and len(c.token_ids) == len(c.logprobs) == len(c.versions)
                   for c in g)
        assert len({tuple(c.token_ids) for c in g}) > 1
    again = eng.generate(prompts[:3], params)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in out]
    assert [[c.logprobs for c in g] for g in again] == [[c.logprobs for c in g] for g in out]
    other = eng.generate(prompts[:3], SamplingParams(temperature=1.0, n=4, max_new_tokens=8, seed=12))
    assert [[c.token_ids for c in g] for g in other] != [[c.token_ids for c in g] for g in out]


def test_prompt_prefilled_once_per_group(model, tok, prompts):
    eng = engine(model, tok, max_batch=64)
    rows = []
    real = eng.runner.prefill
    eng.runner.prefill = lambda ps: rows.append(len(ps)) or real(ps)
    eng.generate(prompts[:3], SamplingParams(n=5, max_new_tokens=4, seed=0))
    assert rows == [3]


def test_top_k_one_is_greedy(model, tok, prompts):
    eng = engine(model, tok)
    greedy = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    topk = eng.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=10, seed=5))
    assert [g[0].token_ids for g in topk] == [g[0].token_ids for g in greedy]


def test_stop_string_stop_token_and_length(model, tok, prompts):
    eng = engine(model, tok)
    ref = eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=10))[0][0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10
    # Stop string: two characters from the middle of the greedy text.
    stop = ref.text[4:6]
    cut = next(k for k in range(1, 11) if stop in tok.decode(ref.token_ids[:k], skip_special_tokens=True))
    c = eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=10, stop_strings=[stop]))[0][0]
    assert c.finish_reason == "stop" and c.token_ids == ref.token_ids[:cut] and stop in c.text
    # Stop token: the greedy token at position 3 ends the completion there (and is kept).
    t = ref.token_ids[3]
    first = ref.token_ids.index(t)
    c = eng.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[t]))[0][0]
    assert c.finish_reason == "stop" and c.token_ids == ref.token_ids[:first + 1]
    short = eng.generate(prompts, SamplingParams(temperature=0.9, max_new_tokens=3, seed=1))
    assert all(len(g[0].token_ids) == 3 and g[0].finish_reason == "length" for g in short
               if tok.eos_token_id not in g[0].token_ids)


def test_update_weights_in_place_and_errors(model, tok, prompts):
    other = tiny(tok, seed=7).eval()
    eng = engine(model, tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    before = eng.generate(prompts, params)
    ptr = eng.model.lm_head.weight.data_ptr()
    eng.update_weights(other.state_dict(), version=3)
    after = eng.generate(prompts, params)
    assert eng.version == 3 and eng.model.lm_head.weight.data_ptr() == ptr
    for prompt, (c,) in zip(prompts, after):
        assert c.token_ids == hf_greedy(other, prompt, 10, tok.eos_token_id)
        assert c.versions == [3] * len(c.token_ids)
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]
    # An iterable of pairs works too (a streaming transport).
    eng.update_weights(((n, p) for n, p in model.named_parameters()), version=4)
    assert eng.generate(prompts, params)[0][0].token_ids == before[0][0].token_ids
    with pytest.raises(ValueError, match="unknown parameter 'model.nope'"):
        eng.update_weights({"model.nope": torch.zeros(1)}, version=5)
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape .*got \(3, 64\)"):
        eng.update_weights({"lm_head.weight": torch.zeros(3, 64)}, version=5)
    assert eng.version == 4


def test_update_between_decode_steps_changes_versions(model, tok, prompts):
    eng = engine(model, tok)
    calls = {"n": 0}

    def swap_after_third_forward(*_):
        calls["n"] += 1
        if calls["n"] == 3:
            eng.update_weights(dict(eng.model.named_parameters()), version=1)

    eng.model.register_forward_hook(swap_after_third_forward)
    c = eng.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=6))[0][0]
    # Forward 1 is the prefill, forwards 2 and 3 are decode steps run with version 0.
    assert c.versions == [0, 0, 0, 1, 1, 1]


def test_eos_bias_ends_at_first_token(model, tok, prompts):
    eng = engine(model, tok)
    out = eng.generate(prompts, SamplingParams(temperature=1.0, n=3, max_new_tokens=8, eos_bias=1e4, seed=0))
    for g in out:
        for c in g:
            assert c.token_ids == [tok.eos_token_id] and c.finish_reason == "stop" and c.text == ""
            assert abs(c.logprobs[0]) < 1e-6  # the biased distribution puts all mass on EOS


def test_more_requests_than_slots(model, tok):
    many = [tok.encode(TEXTS[i % len(TEXTS)] * (1 + i % 3)) for i in range(10)]
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=9, stop_token_ids=frequent_stops(tok))
    small = engine(model, tok, max_batch=4).generate(many, params)
    large = engine(model, tok, max_batch=64).generate(many, params)
    # A tiny prefill budget splits prefills into chunks that are merged and put back in order.
    chunked = engine(model, tok, max_batch=64, prefill_token_budget=20).generate(many, params)
    assert [[(c.token_ids, c.finish_reason) for c in g] for g in small] == \
           [[(c.token_ids, c.finish_reason) for c in g] for g in large] == \
           [[(c.token_ids, c.finish_reason) for c in g] for g in chunked]
    for a, b in zip(small, large):
        for x, y in zip(a, b):
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5


def test_context_limit(tok):
    short = tiny(tok, max_position_embeddings=16).eval()
    eng = NativeEngine(short, tok, device="cpu")
    with pytest.raises(ValueError, match="prompt 1 has 16 tokens but the model context is 16"):
        eng.generate([[5, 6], [7] * 16], SamplingParams(max_new_tokens=4))
    out = eng.generate([[7] * 12], SamplingParams(temperature=0.0, max_new_tokens=10))[0][0]
    assert len(out.token_ids) <= 4
    assert out.finish_reason == ("length" if len(out.token_ids) == 4 else "stop")


def test_params_from_config():
    from conveyor.config import RolloutConfig

    cfg = RolloutConfig(n=4, temperature=0.5, top_k=3, stop=["\n"], eos_bias=-2.0)
    p = SamplingParams.from_config(cfg, seed=9)
    assert (p.n, p.temperature, p.top_k, p.stop_strings, p.eos_bias, p.seed) == (4, 0.5, 3, ("\n",), -2.0, 9)


def test_edge_cases_and_protocol(model, tok):
    eng = engine(model, tok)
    assert isinstance(eng, RolloutEngine)
    assert eng.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        eng.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate([[5]], SamplingParams())


def seeds_for(n: int, key: int = 1) -> torch.Tensor:
    return torch.from_numpy(draw_seeds([request_key(key, i, 0) for i in range(n)], [0] * n))


def test_sampler_top_p_keeps_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    tokens, lps = sample(logits, temperature=1.0, top_p=0.7, seeds=seeds_for(2000))
    assert set(tokens.tolist()) == {0, 1}
    # The nucleus {0, 1} renormalised: 0.5 / 0.8 and 0.3 / 0.8.
    assert abs((tokens == 0).float().mean().item() - 0.625) < 0.04
    assert torch.allclose(lps, torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))[tokens])


def test_keyed_sampler_draws_the_distribution_and_depends_on_its_row_seed_only():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    logits = torch.log(probs).repeat(6000, 1)
    seeds = seeds_for(6000)
    tokens, _ = sample(logits, temperature=1.0, seeds=seeds)
    freq = torch.bincount(tokens, minlength=5) / 6000
    assert (freq - probs).abs().max().item() < 0.02, freq
    hot, _ = sample(logits, temperature=2.0, seeds=seeds)  # tempered: probs ** 0.5, renormalised
    flat = probs.sqrt() / probs.sqrt().sum()
    assert ((torch.bincount(hot, minlength=5) / 6000) - flat).abs().max().item() < 0.02
    # Each row's token is a function of its own seed: reversing the rows reverses the tokens,
    # and a row drawn alone (another batch size) gets its token of the full batch.
    again, _ = sample(logits.flip(0), temperature=1.0, seeds=seeds.flip(0))
    assert torch.equal(again, tokens.flip(0))
    alone = [int(sample(logits[:1], temperature=1.0, seeds=seeds[i:i + 1])[0]) for i in range(0, 6000, 600)]
    assert alone == tokens[::600].tolist()
    # Other seeds, other draws; a missing seed is an error, greedy needs none.
    assert not torch.equal(sample(logits, temperature=1.0, seeds=seeds_for(6000, key=2))[0], tokens)
    with pytest.raises(ValueError, match="one seed per row"):
        sample(logits, temperature=1.0)
    assert sample(logits[:3], temperature=0.0)[0].tolist() == [0, 0, 0]


def test_draw_seeds_and_request_keys_are_distinct_and_31_bit():
    keys = {request_key(s, i, j) for s in range(3) for i in range(40) for j in range(8)}
    assert len(keys) == 3 * 40 * 8 - 2 * 39 * 8  # prompt i of seed s is prompt 0 of seed s + i
    assert request_key(5, 3, 1) == request_key(8, 0, 1)
    seeds = draw_seeds(sorted(keys) * 20, [k for k in range(20) for _ in keys])
    assert seeds.min() >= 0 and seeds.max() < 2**31
    assert len(set(seeds.tolist())) > 0.999 * len(seeds)


# ----- continuous batching (generate_stream, fast runner) ----------------------------------
STREAM_TEXTS = ["a", "b", "ok", "c", "no", "The quick brown fox", "hi there", "1+2="]


def fast_engine(model, tok, **kw):
    kw.setdefault("kv_blocks", 64)
    return engine(model, tok, runner="fast", **kw)


def short_and_long(eng, tok, params):
    """Two prompts whose greedy completions under ``params`` are the shortest and a full-budget one."""
    ps = [tok.encode(t) for t in STREAM_TEXTS]
    lengths = [len(g[0].token_ids) for g in eng.generate(ps, params)]
    long_i = lengths.index(params.max_new_tokens)
    short_i = lengths.index(min(lengths))
    assert lengths[short_i] <= 3, lengths  # the tiny model's greedy text hits a stop token early
    return ps[short_i], ps[long_i]


class Script:
    """intake() returns the chunks scheduled for each call number; on_done records when each
    prompt was reported; ``done[tag]`` is (call of the chunk's last report, its completions)."""

    def __init__(self, schedule: dict[int, list]):
        self.schedule, self.calls, self.parts, self.sizes = schedule, 0, {}, {}

    def intake(self):
        self.calls += 1
        chunks = [StreamChunk(*c) for c in self.schedule.pop(self.calls, [])]
        self.sizes.update({c.tag: len(c.prompts) for c in chunks})
        return chunks

    def on_done(self, tag, i, samples):
        assert (tag, i) not in self.parts, f"chunk {tag} prompt {i} reported twice"
        self.parts[tag, i] = (self.calls, samples)

    @property
    def done(self):
        out = {}
        for tag, n in self.sizes.items():
            parts = [self.parts.get((tag, i)) for i in range(n)]
            if all(parts):
                out[tag] = (max(c for c, _ in parts), [s for _, s in parts])
        return out


def test_the_host_counts_the_time_it_waits_for_the_device(model, tok, monkeypatch):
    """``device_wait_s``: the reads of a step's tokens that block on the device's event. A CPU
    engine has no event (the host computes the step itself): it counts nothing."""
    import time

    from conveyor.rollout.native import paged_loop
    eng = fast_engine(model, tok, max_batch=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompts = [tok.encode("ab"), tok.encode("ba a")]
    before = dict(eng.counters)
    eng.generate(prompts, params)
    assert eng.counters["device_wait_s"] == before["device_wait_s"]

    class SlowEvent:  # a device step still running for 3 ms when the host reads it
        def synchronize(self):
            time.sleep(0.003)

    launch = paged_loop.PagedLoop._launch
    monkeypatch.setattr(paged_loop.PagedLoop, "_launch",
                        lambda self, *a: _with_done(launch(self, *a), SlowEvent()))
    before = dict(eng.counters)
    eng.generate(prompts, params)
    c = {k: v - before.get(k, 0) for k, v in eng.counters.items()}
    reads = c["decode_steps"] + 1  # every decode step's tokens and the prefill's are read once
    assert c["device_wait_s"] >= 0.003 * reads
    assert c["device_wait_s"] <= c["decode_s"] + c["prefill_s"]


def _with_done(step, done):
    step.done = done
    return step


def test_stream_admits_chunks_mid_generation_and_reports_each_when_done(model, tok):
    eng = fast_engine(model, tok, max_batch=8, refill=1)
    assert eng.streams and not engine(model, tok).streams  # the HF runner cannot stream
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=frequent_stops(tok))
    short, long = short_and_long(eng, tok, params)
    script = Script({1: [("A", [long, short])], 4: [("B", [short, short])], 6: [("C", [long])]})
    before = dict(eng.counters)
    eng.generate_stream(params, script.intake, script.on_done)
    assert set(script.done) == {"A", "B", "C"}
    # Iteration k (after the k-th intake call) queues a decode step and reads the tokens of
    # the one before, so A's samples have k tokens then and its 40-token sample is reported
    # after call 40. B came on call 4 and is short: it is reported long before A ends; C
    # came on call 6 and ends 39 calls later, without waiting for A.
    assert script.done["B"][0] < 10 and script.done["A"][0] == 40 and script.done["C"][0] == 45
    # Within chunk A the short prompt is reported on its own, long before A's long prompt.
    assert script.parts["A", 1][0] < 10 and script.parts["A", 0][0] == 40
    # Counters: every token after a request's first (sampled at its prefill) came from one
    # decode row; the last decode step is C's 44th token, as the report step above says.
    c = {k: v - before.get(k, 0) for k, v in eng.counters.items()}
    tokens = [len(s.token_ids) for _, groups in script.done.values() for g in groups for s in g]
    assert c["decode_rows"] == sum(t - 1 for t in tokens) and c["decode_steps"] == 44
    assert c["decode_s"] > 0 and c["prefill_s"] > 0
    # decode time by the rows of the steps, in powers of two: at most five sequences were in
    # flight at once (A's two, B's two, C's one), so every step falls in a bucket up to 8
    by_rows = {k: v for k, v in c.items() if k.startswith("decode_s_rows_le_") and v > 0}
    assert by_rows and set(by_rows) <= {f"decode_s_rows_le_{b}" for b in (1, 2, 4, 8)}, by_rows
    assert sum(by_rows.values()) <= c["decode_s"] * (1 + 1e-9)
    for tag, prompts in [("A", [long, short]), ("B", [short, short]), ("C", [long])]:
        alone = eng.generate(prompts, params)
        got = script.done[tag][1]
        assert [[(c.token_ids, c.finish_reason) for c in g] for g in got] == \
               [[(c.token_ids, c.finish_reason) for c in g] for g in alone], tag
        assert all(max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
                   for a, b in zip(got, alone) for x, y in zip(a, b))
    assert eng.runner.allocator.num_free == eng.runner.allocator.capacity  # every block came back


def test_stream_prompt_indices_do_not_collide_across_chunks(model, tok, prompts):
    # Both chunks are admitted in one wave. Were prompt indices local to a chunk, the runner
    # would share chunk X's prompt 0 prefill with chunk Y's prompt 0 (a different text).
    eng = fast_engine(model, tok, max_batch=64)
    params = SamplingParams(temperature=0.0, n=2, max_new_tokens=10)
    x, y = [prompts[0], prompts[2]], [prompts[3], prompts[0]]  # prompts[0] is in both
    prefills = []
    real = eng.runner.prefill
    eng.runner.prefill = lambda reqs: prefills.append(len(reqs)) or real(reqs)
    script = Script({1: [("X", x), ("Y", y)]})
    eng.generate_stream(params, script.intake, script.on_done)
    assert prefills == [8]
    for tag, ps in [("X", x), ("Y", y)]:
        alone = eng.generate(ps, params)
        assert [[c.token_ids for c in g] for g in script.done[tag][1]] == [[c.token_ids for c in g] for g in alone]
    assert script.done["X"][1][0][0].token_ids == script.done["Y"][1][1][0].token_ids  # same text, same greedy


def test_sampled_outputs_depend_on_prompt_and_seed_only(model, tok, prompts):
    """Keyed sampling: batch size, runner, step overlap and streaming leave a seeded sample as is."""
    params = SamplingParams(temperature=1.0, n=3, max_new_tokens=12, seed=7, stop_token_ids=frequent_stops(tok))

    def tokens(out):
        return [[c.token_ids for c in g] for g in out]

    ref = engine(model, tok).generate(prompts, params)  # the dense Hugging Face runner
    assert len({tuple(c.token_ids) for g in ref for c in g}) > len(prompts)  # they differ
    for eng in (engine(model, tok, max_batch=2), fast_engine(model, tok), fast_engine(model, tok, max_batch=4)):
        out = eng.generate(prompts, params)
        assert tokens(out) == tokens(ref)
        assert all(max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
                   for a, b in zip(out, ref) for x, y in zip(a, b))
    # Prompt i of a call seeded s samples as prompt 0 of a call seeded s + i.
    last = engine(model, tok).generate(prompts[4:], dataclasses.replace(params, seed=7 + 4))
    assert tokens(last) == tokens(ref)[4:]
    # Streamed chunks: one with its own seed, one continuing the call's seed.
    eng = fast_engine(model, tok, max_batch=5, refill=1)
    script = Script({1: [("X", prompts[:2], 7)], 3: [("Y", prompts[2:4], 7 + 2)], 4: [("Z", prompts[4:])]})
    eng.generate_stream(params, script.intake, script.on_done)
    assert [x for tag in "XYZ" for x in tokens(script.done[tag][1])] == tokens(ref)


def test_stream_seed_validation_and_abort(model, tok, prompts):
    eng = fast_engine(model, tok, max_batch=4, refill=1)
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=12, seed=5, stop_token_ids=frequent_stops(tok))

    def run():
        script = Script({1: [(0, prompts[:3])], 3: [(1, prompts[3:])]})
        eng.generate_stream(params, script.intake, script.on_done)
        return {t: [[c.token_ids for c in g] for g in out] for t, (_, out) in script.done.items()}

    assert run() == run()  # every sample's stream is keyed by params.seed
    with pytest.raises(ValueError, match="generate_stream chunk 'bad': generate: prompt 1 is empty"):
        eng.generate_stream(params, Script({1: [("bad", [[5], []])]}).intake, lambda *_: None)
    assert eng.runner.allocator.num_free == eng.runner.allocator.capacity
    # Abort during the third decode step. "run" fills all 4 slots and never stops (EOS is
    # biased away), so "wait" is still queued: both chunks are reported, every sample "abort".
    real, steps = eng.runner.decode, []

    def decode(running, *ahead):
        steps.append(1)
        if len(steps) == 3:
            eng.abort()
        return real(running, *ahead)

    eng.runner.decode = decode
    script = Script({1: [("run", prompts[:2])], 2: [("wait", prompts[2:5])]})
    long = SamplingParams(temperature=1.0, n=2, max_new_tokens=50, eos_bias=-1e4, seed=0)
    eng.generate_stream(long, script.intake, script.on_done)
    assert set(script.done) == {"run", "wait"}
    assert [[(c.finish_reason, len(c.token_ids)) for c in g] for g in script.done["run"][1]] == [[("abort", 4)] * 2] * 2
    assert [[(c.finish_reason, c.token_ids) for c in g] for g in script.done["wait"][1]] == [[("abort", [])] * 2] * 3
    assert eng.runner.allocator.num_free == eng.runner.allocator.capacity
    with pytest.raises(NotImplementedError, match="fast runner"):
        engine(model, tok).generate_stream(params, lambda: [], lambda *_: None)


def test_a_prefill_hands_the_head_contiguous_rows_and_the_same_logits(tok, prompts):
    """The last position of each prompt reaches the output head contiguous (torch's matmul copied
    the head weight once per row for the strided view), and the logits are the plain forward's."""
    from conveyor.rollout.native.runner import HFModelRunner
    model = tiny(tok).eval()
    runner = HFModelRunner(model)
    HFModelRunner(model)  # a second runner on the same model adds nothing
    head = model.get_output_embeddings()
    assert len(head._forward_pre_hooks) == 1
    seen = []  # what the head's forward gets, after the runner's hook
    head.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    with torch.inference_mode():
        _, logits = runner.prefill(prompts)
        assert seen == [True]  # one prefill chunk
        for p, row in zip(prompts, logits, strict=True):
            plain = model(input_ids=torch.tensor([p])).logits[0, -1].float()
            torch.testing.assert_close(row, plain, rtol=1e-5, atol=1e-5)  # float32, a different mask path
