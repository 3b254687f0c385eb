"""Packed micro-batches (trainer/packing.py) against the padded forward on the tiny model, CPU float32."""
import pytest
import torch

from conveyor.config import TrainerConfig
from conveyor.trainer import packing
from conveyor.trainer.single import LocalTrainer

LENGTHS = [9, 4, 12, 6, 7, 3, 10, 5]


def cfg(**kw):
    return TrainerConfig(**{"device": "cpu", "lr": 1e-4, "micro_batch_tokens": 4096, **kw})


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _groups(make_batch, prompts=(6, 5), n=4, seed=0):
    """GRPO-shaped batch: ``n`` samples per prompt, the prompt's tokens the same in each (loss 0)."""
    from conveyor.types import Batch
    gen = torch.Generator().manual_seed(seed)
    base = make_batch([p + 2 * n for p in prompts for _ in range(n)], seed=seed)
    ids, masks, adv = [], [], []
    k = 0
    for p in prompts:
        prompt = base.input_ids[k][:p]
        for j in range(n):
            reply = base.input_ids[k][p:p + 1 + (3 * j + k) % 7]
            ids.append(torch.cat([prompt, reply]))
            masks.append(torch.cat([torch.zeros(p), torch.ones(len(reply))]))
            adv.append(torch.randn(len(ids[-1]), generator=gen) * masks[-1])
            k += 1
    return Batch(ids, masks, {"adv": adv, "returns": [a.clone() for a in adv]})


def test_plan_fits_real_tokens_and_covers_every_sample():
    lengths = [30, 5, 17, 17, 1, 40, 9, 1]
    groups = packing.plan(lengths, 40)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 40 for g in groups)
    assert len(groups) == 3  # 40 | 30 + 9 + 1 | 17 + 17 + 5 + 1: no padding, so fewer passes
    assert packing.plan([50, 3], 10) == [[0], [1]]  # a longer sample alone, never cut
    with pytest.raises(ValueError, match="max_tokens"):
        packing.plan([1], 0)


def test_modes_and_bad_input():
    cpu = torch.device("cpu")
    assert not packing.wanted("auto", cpu, compiled=False)  # auto packs on a GPU only
    assert packing.wanted("on", cpu, compiled=False) and not packing.wanted("off", cpu, compiled=False)
    with pytest.raises(ValueError, match="trainer.pack_sequences=on does not combine with trainer.compile"):
        packing.wanted("on", cpu, compiled=True)
    assert packing.wanted("shared", cpu, compiled=False)
    with pytest.raises(ValueError, match="trainer.pack_sequences=shared does not combine"):
        packing.wanted("shared", cpu, compiled=True)
    with pytest.raises(ValueError, match="use auto, on, shared or off"):
        packing.wanted("yes", cpu, compiled=False)


def test_attention_per_sample_equals_a_block_diagonal_mask():
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, cu = 4, 2, 8, [0, 5, 6, 13]
    q = torch.randn(1, heads, cu[-1], d, generator=gen)
    k, v = (torch.randn(1, kv_heads, cu[-1], d, generator=gen) for _ in range(2))
    got, _ = packing.attention(None, q, k, v, None, scaling=d ** -0.5, cu_seq_lens_q=torch.tensor(cu),
                               max_length_q=7)
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 1, 7]))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(13, 13, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=d ** -0.5,
                                                            enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # float32 softmax of values ~1



def test_shared_attention_runs_in_float32_on_a_cpu_under_bf16_autocast():
    # Under bf16 autocast torch would run the attention in bf16 (errors of a bf16 rounding, 2**-9
    # of values ~1, plus the rounded scores); the CPU path runs it in float32, whose error on
    # these ~1-sized values, against float64, stays below 1e-5.
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, d = 6, 2, 16
    groups = (packing.Group(0, 7, (5, 3)), packing.Group(15, 9, ()))
    n = 24
    q = torch.randn(1, heads, n, d, generator=gen)
    k, v = (torch.randn(1, kv_heads, n, d, generator=gen) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = packing.attention(None, q, k, v, None, scaling=d ** -0.5, conveyor_groups=groups)
    assert got.dtype == torch.float32
    want = []
    for g in groups:
        s, e = g.start, g.start + g.size
        want.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s:e].double(), k[:, :, s:e].double(), v[:, :, s:e].double(), attn_mask=g.mask(),
            scale=d ** -0.5, enable_gqa=True))
    want = torch.cat(want, dim=2).transpose(1, 2)
    assert (got.double() - want).abs().max().item() < 1e-5

def test_packed_logprobs_equal_the_padded_ones(make_model, make_batch):
    batch = make_batch(LENGTHS)
    padded = LocalTrainer(make_model(), cfg(pack_sequences="off"), total_steps=1)
    packed = LocalTrainer(make_model(), cfg(pack_sequences="on"), total_steps=1)
    assert packed._packed and not padded._packed
    assert packed.compute.config._attn_implementation == packing.NAME
    for a, b in zip(padded.logprobs(batch), packed.logprobs(batch)):
        assert a.shape == b.shape and b[0] == 0.0
        # float32 logprobs of a 2-layer model (|logprob| ~ 6): the same sums in another order
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("mode", ["on", "shared"])
def test_a_packed_step_equals_the_padded_step(make_model, make_batch, pg_value_loss, checkpointing, mode):
    # shared: GRPO-shaped groups, each prompt computed once and every reply attending to it
    batch = make_batch(LENGTHS) if mode == "on" else _groups(make_batch)
    kw = {"critic": True, "gradient_checkpointing": checkpointing, "micro_batch_tokens": 20 if mode == "on" else 40}
    padded = LocalTrainer(make_model(), cfg(pack_sequences="off", **kw), total_steps=1)
    packed = LocalTrainer(make_model(), cfg(pack_sequences=mode, **kw), total_steps=1)
    m1, m2 = padded.train(batch, pg_value_loss), packed.train(batch, pg_value_loss)
    assert m2["microbatches"] < m1["microbatches"]  # no padding in the budget: fewer, fuller passes
    assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-5)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)
    assert m2["mean_logprob"] == pytest.approx(m1["mean_logprob"], abs=1e-5)
    # Adam's first step turns rounding on near-zero gradients into a few percent of lr (1e-4):
    # compared at 5% of it, while the step moves weights by about lr.
    assert max_diff(padded.model, packed.model) <= 5e-6
    assert max_diff(padded.critic, packed.critic) <= 5e-6
    assert max_diff(packed.model, make_model()) > 5e-5


def test_the_packed_head_runs_only_where_a_token_is_scored(make_model, make_batch, pg_loss, monkeypatch):
    batch = make_batch(LENGTHS)
    trainer = LocalTrainer(make_model(), cfg(pack_sequences="on"), total_steps=1)
    rows = []
    head = trainer.compute.lm_head
    monkeypatch.setattr(head, "forward", lambda x: rows.append(x.shape[1]) or torch.nn.Linear.forward(head, x))
    trainer.train(batch, pg_loss)
    assert rows == [int(sum(m.sum() for m in batch.loss_mask))]  # one pass, loss tokens only
    rows.clear()
    trainer.logprobs(batch)
    assert rows == [sum(n - 1 for n in LENGTHS)]  # every real token but each sample's first


def test_entropy_packed_equals_padded(make_model, make_batch):
    batch = make_batch([7, 5, 3])
    outs = []
    for mode in ("off", "on"):
        trainer = LocalTrainer(make_model(), cfg(pack_sequences=mode), total_steps=1)
        from conveyor.trainer.microbatch import collate
        mb = collate(batch, [0, 1, 2], 0)
        with torch.no_grad():
            outs.append(trainer._policy_out(trainer.compute, trainer._to_device(mb), True,
                                            layout=trainer._layout(mb, loss_only=True)))
    m = torch.stack([torch.nn.functional.pad(x, (0, 7 - x.numel())) for x in batch.loss_mask]).bool()
    for key in ("logprobs", "entropy"):
        torch.testing.assert_close(outs[1][key][m], outs[0][key][m], rtol=0, atol=1e-5)
        assert (outs[1][key][~m] == 0).all()


def test_lora_adapters_train_the_same_packed(make_model, make_batch, pg_loss):
    batch = make_batch(LENGTHS)
    lora = {"enabled": True, "rank": 4}
    padded = LocalTrainer(make_model(), cfg(pack_sequences="off", lr=1e-3, lora=lora), total_steps=1)
    packed = LocalTrainer(make_model(), cfg(pack_sequences="on", lr=1e-3, lora=lora), total_steps=1)
    assert packed._packed
    for a, b in zip(padded.logprobs(batch), packed.logprobs(batch)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    m1, m2 = padded.train(batch, pg_loss), packed.train(batch, pg_loss)
    assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-5)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-4)


def test_shared_layout_computes_each_prompt_once_and_scores_every_branch():
    am = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 3, 4, 2], [5, 6, 7, 1, 0, 0], [9, 9, 1, 0, 0, 0]])
    lm = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0]])
    lay = packing.Layout.shared_of(am, lm > 0, ids, lm)
    assert lay.groups == (packing.Group(0, 3, (2, 3, 1)), packing.Group(9, 3, ()))  # 12 of 18 tokens
    assert lay.real.numel() == 12 and lay.positions[0, :6].tolist() == [0, 1, 2, 3, 4, 3]
    # The prompt's last token (packed row 2) scores each branch's first token.
    assert sorted(lay.dest[lay.keep == 2].tolist()) == [3, 9, 15]
    assert lay.dest.numel() == int(lm.sum())
    allowed = packing.Group(0, 2, (2, 1)).mask()
    assert allowed.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                      [1, 1, 0, 0, 1]]


def test_plan_shared_keeps_a_prompts_samples_together_and_counts_the_prompt_once():
    keys = [(b"a", 10)] * 4 + [(b"b", 8)] * 2
    lengths = [14, 12, 11, 13, 9, 10]
    plan = packing.plan_shared(lengths, keys, 30)
    assert sorted(i for g in plan for i in g) == list(range(6))
    assert [0, 1, 2, 3] in [sorted(g) for g in plan]  # 10 + 4 + 2 + 1 + 3 = 20 tokens, not 50
    split = packing.plan_shared(lengths, keys, 16)  # a prompt's samples do not fit together: pieces
    assert all(sum(lengths[i] for i in g) - 10 * (sum(keys[i][0] == b"a" for i in g) - 1) <= 16
               for g in split if all(keys[i][0] == b"a" for i in g))


def test_shared_prompt_logprobs_equal_the_padded_ones(make_model, make_batch):
    batch = _groups(make_batch)
    padded = LocalTrainer(make_model(), cfg(pack_sequences="off"), total_steps=1)
    shared = LocalTrainer(make_model(), cfg(pack_sequences="shared"), total_steps=1)
    assert shared._shared
    for a, b in zip(padded.logprobs(batch), shared.logprobs(batch)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)  # as the packed test: float32, |logprob| ~ 6


def test_shared_prompts_run_fewer_tokens(make_model, make_batch, pg_loss, monkeypatch):
    batch = _groups(make_batch, prompts=(8, 8, 7), n=4)
    trainer = LocalTrainer(make_model(), cfg(pack_sequences="shared"), total_steps=1)
    seen = []
    model = trainer.compute.model
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: seen.append(k["input_ids"].shape[1]) or forward(*a, **k))
    trainer.train(batch, pg_loss)
    real = sum(int(x.numel()) for x in batch.input_ids)
    assert seen == [real - 3 * 8 - 3 * 8 - 3 * 7]  # one forward; each prompt once, not four times


def test_the_direct_flash_call_takes_only_causal_windows_and_says_so():
    from conveyor.trainer.kernels import flash_varlen
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="only causal"):
        flash_varlen.varlen_attn(q, q, q, None, None, 4, 4, window_size=(-1, -1))
    with pytest.raises(ValueError, match="not a multiple"):
        flash_varlen.varlen_attn(torch.zeros(4, 3, 8), q, q, None, None, 4, 4)
