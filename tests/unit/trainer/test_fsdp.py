"""FSDPTrainer and ReplicatedTrainer on 2 CPU ranks (gloo) against LocalTrainer on one device.

One job does all the distributed work: this file, run as a script, is each
rank's worker (pytest's importlib mode leaves test modules unimportable by
name, so a torch.multiprocessing target here could not be unpickled in a
child). The ranks rendezvous through a file store (no port to race for),
every collective has the process group's 60 s deadline and the job a 240 s
one, after which it is killed and the test fails with the ranks' logs. The
tests compare the saved results with LocalTrainer in the pytest process.
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conveyor.config import AlgoConfig, TrainerConfig
from conveyor.controller.objective import PolicyLoss
from conveyor.types import Batch

pytestmark = pytest.mark.slow  # two trainer rank processes per module: over 10 s on a 2-core CPU

WORLD = 2
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            max_position_embeddings=64)
# mini_batches=2 cuts this into [20, 3, 4, 5] and [9, 8, 2, 6]. With a 10-token
# budget rank 0 gets [20] (1 micro-batch) and rank 1 [5, 4] + [3] (2), so rank
# 0 runs a dummy pass; LocalTrainer plans 3 and 4 micro-batches, as the ranks do together.
LENGTHS = [20, 3, 4, 5, 9, 8, 2, 6]
CFG = dict(device="cpu", lr=1e-4, critic_lr=1e-4, warmup_steps=1, lr_schedule="linear", max_grad_norm=0.5,
           mini_batches=2, micro_batch_tokens=10, reference=True, critic=True)
ALGO = dict(advantage="gae", entropy_coef=0.01, loss_agg="seq-mean-token-mean")  # uses num_seqs, entropy, values
POISON = 1  # sample 1 (3 tokens) is rank 1's second micro-batch of mini-batch 0
DEADLINE_S = 240
HALF = dict(device="cpu", lr=1e-3, mini_batches=2, micro_batch_tokens=10, param_dtype="bfloat16",
            max_grad_norm=0.05)  # low enough to clip: the norm spans sharded and replicated gradients


class Loss(PolicyLoss):
    """The real RL objective (PPO + value loss + entropy), NaN on micro-batches holding a poisoned sample."""

    def __call__(self, out, mb, num_tokens, num_seqs):
        loss, metrics = super().__call__(out, mb, num_tokens, num_seqs)
        return (loss * float("nan") if float(mb["poison"].sum()) > 0 else loss), metrics


# pack_sequences=shared: per sample (prompt, completion) tokens; neighbours with equal prompt
# lengths repeat one prompt, so the batch holds four prompts of two samples each.
SHARED = [(4, 5), (4, 3), (2, 4), (2, 6), (6, 1), (6, 2), (3, 3), (3, 3)]


def make_batch(seed: int, behaviour: list[torch.Tensor], poison: bool = False, shared: bool = False) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids, masks, fields = [], [], {k: [] for k in ("advantages", "behaviour_logprobs", "old_values", "returns",
                                                   "poison")}
    for i, n in enumerate([p + c for p, c in SHARED] if shared else LENGTHS):
        if shared:
            p, c = SHARED[i]
            if i == 0 or SHARED[i - 1][0] != p:
                prompt = torch.randint(7, 90, (p,), generator=gen)
            ids.append(torch.cat([prompt, torch.randint(7, 90, (c,), generator=gen)]))
        else:
            ids.append(torch.randint(7, 90, (n,), generator=gen))
        mask = torch.zeros(n)
        mask[SHARED[i][0] if shared else max(1, n // 2):] = 1.0
        masks.append(mask)
        fields["advantages"].append(torch.randn(n, generator=gen) * mask)
        # Near the current policy, so the PPO ratio is near 1 and mostly unclipped.
        fields["behaviour_logprobs"].append((behaviour[i] + 0.05 * torch.randn(n, generator=gen)) * mask)
        fields["old_values"].append(0.1 * torch.randn(n, generator=gen) * mask)
        fields["returns"].append(torch.randn(n, generator=gen) * mask)
        fields["poison"].append(torch.full((n,), float(poison and i == POISON)))
    return Batch(ids, masks, fields)


def full_weights(trainer, critic: bool = True) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {f"policy.{k}": v.detach().cpu().clone() for k, v in trainer.named_weights()}
    for k, v in (trainer.critic.state_dict() if critic else {}).items():
        out[f"critic.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
    return out


# ------------------------------------------------------------------ worker
def resume_then_poison(tr, ckpt: Path, b: list[Batch], loss, res: dict, key: str) -> None:
    """Load the step-2 checkpoint, take step 3, fail a step on one rank, then take the next one."""
    res[f"{key}extra"], res[f"{key}step_loaded"] = tr.load(ckpt), tr.step
    res[f"{key}m3b"] = tr.train(b[2], loss)
    res[f"{key}w3b"] = full_weights(tr)
    try:
        tr.train(b[4], loss)  # poisoned on rank 1 only
    except Exception as e:  # noqa: BLE001 - recorded for the test
        res[f"{key}nan_error"] = (type(e).__name__, str(e))
    res[f"{key}w_after_nan"], res[f"{key}step_after_nan"] = full_weights(tr), tr.step
    tr.train(b[3], loss)
    res[f"{key}w4b"] = full_weights(tr)


def worker(rank: int, work: Path) -> None:
    import torch.distributed as dist

    from torch.distributed.tensor import DTensor

    from conveyor.trainer.fsdp import FSDPTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{work / 'rendezvous'}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    inputs = torch.load(work / "inputs.pt", weights_only=False)
    b, loss, tiny = inputs["batches"], Loss(AlgoConfig(**ALGO)), inputs["tiny_dir"]
    # gradient checkpointing is on here only: the comparison also covers it.
    cfg = TrainerConfig(**CFG, gradient_checkpointing=True)
    res = {}
    tr = FSDPTrainer(tiny, cfg, total_steps=6)
    # The memory probe (trainer/fit.py) on sharded ranks, the critic included: every comparison
    # below with the local trainer also checks that it left nothing behind.
    res["to_come"] = tr._state_to_come()
    tr._probe(40, 20)
    res["lp0"], res["ref0"], res["v0"] = tr.logprobs(b[0]), tr.ref_logprobs(b[0]), tr.values(b[0])
    res["metrics"] = [tr.train(b[0], loss), tr.train(b[1], loss)]
    res["to_come_after"] = tr._state_to_come()
    res["w2"], res["lp2"] = full_weights(tr), tr.logprobs(b[0])
    res["bf16"] = sorted({str(v.dtype) for _, v in tr.named_weights(torch.bfloat16)})
    tr.save(work / "ckpt", {"cursor": 2})
    tr.save(work / "ckpt", {"cursor": 2, "again": True})  # overwriting works
    tr.export_hf(work / "hf")
    res["m3"] = tr.train(b[2], loss)
    res["w3"] = full_weights(tr)
    tr.train(b[3], loss)
    res["w4"] = full_weights(tr)

    # Weights kept gathered for a whole step: the same numbers, fresh weights after every step.
    kept = FSDPTrainer(tiny, cfg.model_copy(update={"fsdp_reshard": "step"}), total_steps=6)
    res["kept_lp0"] = kept.logprobs(b[0])
    res["kept_metrics"] = [kept.train(b[0], loss), kept.train(b[1], loss)]
    res["kept_w2"], res["kept_lp2"] = full_weights(kept), kept.logprobs(b[0])
    del kept

    # Packed micro-batches (samples end to end, attention per sample) on sharded ranks.
    packed = FSDPTrainer(tiny, cfg.model_copy(update={"pack_sequences": "on"}), total_steps=6)
    res["packed_lp0"] = packed.logprobs(b[0])
    res["packed_metrics"] = [packed.train(b[0], loss), packed.train(b[1], loss)]
    res["packed_w2"] = full_weights(packed)
    del packed

    resume_then_poison(FSDPTrainer(tiny, cfg, total_steps=6), work / "ckpt", b, loss, res, "")

    # bf16 linear weights (norms, embeddings, head float32) under autocast, as LocalTrainer's copy.
    half = FSDPTrainer(tiny, TrainerConfig(**HALF), total_steps=6)
    # Before any forward: the root leaves its parameters gathered after a forward-only pass.
    res["half_whole"] = sorted(n for n, p in half.model.named_parameters() if not isinstance(p, DTensor))
    res["half_lp0"] = half.logprobs(b[0])
    res["half_m"] = half.train(b[0], PolicyLoss(AlgoConfig()))
    res["half_w"], res["half_lp1"] = full_weights(half, critic=False), half.logprobs(b[0])
    half.save(work / "half_ckpt", {})
    res["half_m2"] = half.train(b[1], PolicyLoss(AlgoConfig()))
    res["half_w2"] = full_weights(half, critic=False)
    again = FSDPTrainer(tiny, TrainerConfig(**HALF), total_steps=6)
    again.load(work / "half_ckpt")
    again.train(b[1], PolicyLoss(AlgoConfig()))
    res["half_w2b"] = full_weights(again, critic=False)
    # The critic's norm weights are whole too: its gradients are summed and stepped the same way.
    hc = FSDPTrainer(tiny, TrainerConfig(**HALF, critic=True, critic_lr=1e-3), total_steps=6)
    res["hc_m"], res["hc_w"] = hc.train(b[0], loss), full_weights(hc)
    # Whole-model ranks (trainer.parallel=replicate): each rank trains its share alone, one gradient sum.
    from conveyor.trainer.replicated import ReplicatedTrainer
    rcfg = cfg.model_copy(update={"parallel": "replicate"})
    rep = ReplicatedTrainer(tiny, rcfg, total_steps=6)
    rep._probe(40, 20)  # as above: the comparisons below check that it changed nothing
    res["rep_lp0"], res["rep_ref0"], res["rep_v0"] = rep.logprobs(b[0]), rep.ref_logprobs(b[0]), rep.values(b[0])
    res["rep_metrics"] = [rep.train(b[0], loss), rep.train(b[1], loss)]
    res["rep_w2"] = full_weights(rep)
    rep.save(work / "rep_ckpt", {"cursor": 2}, wait=False)
    res["rep_m3"] = rep.train(b[2], loss)
    res["rep_w3"] = full_weights(rep)
    rep.export_hf(work / "rep_hf")
    rep.train(b[3], loss)
    res["rep_w4"] = full_weights(rep)
    resume_then_poison(ReplicatedTrainer(tiny, rcfg, total_steps=6), work / "rep_ckpt", b, loss, res, "rep_")
    # Prompts shared (pack_sequences=shared): each rank is dealt whole prompts and computes each once.
    for key, cls, c in (("fsdp", FSDPTrainer, cfg), ("rep", ReplicatedTrainer, rcfg)):
        tr = cls(tiny, c.model_copy(update={"pack_sequences": "shared"}), total_steps=6)
        res[f"shared_{key}_m"] = [tr.train(sb, loss) for sb in inputs["shared"]]
        res[f"shared_{key}_w"] = full_weights(tr)
    torch.save(res, work / f"rank{rank}.pt")
    dist.destroy_process_group()


# ----------------------------------------------------------- pytest side
def run_job(work: Path) -> list[dict]:
    procs, logs = [], []
    for rank in range(WORLD):
        logs.append(open(work / f"rank{rank}.log", "w"))
        procs.append(subprocess.Popen([sys.executable, __file__, str(rank), str(work)],
                                      stdout=logs[-1], stderr=subprocess.STDOUT))
    deadline = time.monotonic() + DEADLINE_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(f"--- rank {r} (rc {p.returncode})\n" + (work / f"rank{r}.log").read_text()[-3000:]
                          for r, p in enumerate(procs))
        pytest.fail(f"FSDP job failed or passed its {DEADLINE_S} s deadline:\n{tails}")
    return [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def job(tiny_dir, tmp_path_factory):
    from conveyor.trainer.single import LocalTrainer

    work = tmp_path_factory.mktemp("fsdp")
    initial = LocalTrainer(tiny_dir, TrainerConfig(device="cpu"), total_steps=1)
    probe = make_batch(0, [torch.zeros(n) for n in LENGTHS])
    behaviour = initial.logprobs(probe)
    batches = [make_batch(s, behaviour) for s in range(4)] + [make_batch(3, behaviour, poison=True)]
    probe = make_batch(0, [torch.zeros(p + c) for p, c in SHARED], shared=True)
    shared = [make_batch(s, initial.logprobs(probe), shared=True) for s in (5, 6)]
    torch.save({"batches": batches, "shared": shared, "tiny_dir": str(tiny_dir)}, work / "inputs.pt")
    ranks = run_job(work)

    loss = Loss(AlgoConfig(**ALGO))
    local = LocalTrainer(tiny_dir, TrainerConfig(**CFG), total_steps=6)
    ref = {"lp0": local.logprobs(batches[0]), "ref0": local.ref_logprobs(batches[0]),
           "v0": local.values(batches[0])}
    ref["metrics"] = [local.train(batches[0], loss), local.train(batches[1], loss)]
    ref["w2"], ref["lp2"] = full_weights(local), local.logprobs(batches[0])
    local.train(batches[2], loss)
    ref["w3"] = full_weights(local)
    half = LocalTrainer(tiny_dir, TrainerConfig(**HALF), total_steps=6)
    ref["half_lp0"] = half.logprobs(batches[0])
    ref["half_m"] = half.train(batches[0], PolicyLoss(AlgoConfig()))
    ref["half_w"], ref["half_lp1"] = full_weights(half, critic=False), half.logprobs(batches[0])
    ref["half_m2"] = half.train(batches[1], PolicyLoss(AlgoConfig()))
    ref["half_w2"] = full_weights(half, critic=False)
    hc = LocalTrainer(tiny_dir, TrainerConfig(**HALF, critic=True, critic_lr=1e-3), total_steps=6)
    ref["hc_m"], ref["hc_w"] = hc.train(batches[0], loss), full_weights(hc)
    sh = LocalTrainer(tiny_dir, TrainerConfig(**CFG, pack_sequences="shared"), total_steps=6)
    ref["shared_m"] = [sh.train(b, loss) for b in shared]
    ref["shared_w"] = full_weights(sh)
    return work, ranks, ref


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_train_matches_local_trainer(job):
    _, ranks, ref = job
    assert max_diff(ranks[0]["w2"], ranks[1]["w2"]) == 0.0
    assert max_diff(ranks[0]["w2"], ref["w2"]) <= 1e-6
    assert max_diff(ranks[0]["w2"], ranks[0]["w3"]) > 1e-5  # the third step moved the weights
    for got0, got1, want in zip(ranks[0]["metrics"], ranks[1]["metrics"], ref["metrics"]):
        assert got0 == got1  # identical on every rank, time_s included
        assert got0.keys() == want.keys()
        assert got0["microbatches"] == want["microbatches"] == 7.0
        assert (got0["num_tokens"], got0["num_seqs"], got0["lr"]) == (want["num_tokens"], 8.0, want["lr"])
        for key in sorted(set(want) - {"microbatches", "num_tokens", "num_seqs", "lr", "time_s"}):
            assert got0[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert ref["metrics"][0]["grad_norm"] > CFG["max_grad_norm"]  # so clipping is exercised
    assert max_diff(ranks[0]["w3"], ref["w3"]) <= 1e-6


def test_the_memory_probe_counts_the_optimizer_state_still_to_come_on_each_rank(job):
    for r in job[1]:  # this rank's shards (and its whole norm weights), policy and critic; none once stepped
        assert r["to_come"] > 0 and r["to_come_after"] == 0


def test_weights_kept_gathered_for_a_step_give_the_same_numbers(job):
    """fsdp_reshard=step gathers each layer once per step; a layer left gathered across an
    optimizer step would compute with stale weights, which the second step and the logprobs
    after it would show."""
    _, ranks, _ = job
    for r in ranks:
        assert max_diff(r["kept_w2"], r["w2"]) == 0.0
        for got, want in zip(r["kept_lp0"] + r["kept_lp2"], r["lp0"] + r["lp2"]):
            assert torch.equal(got, want)
        for got, want in zip(r["kept_metrics"], r["metrics"]):
            assert {k: v for k, v in got.items() if k != "time_s"} == {k: v for k, v in want.items() if k != "time_s"}


def test_packed_ranks_give_the_padded_numbers(job):
    """Packed, the ranks plan by real tokens (never more micro-batches) and attend per sample; the
    numbers are the padded ranks' to float32 rounding. Two Adam steps at lr 1e-4 turn rounding
    on near-zero gradients into a few percent of lr per step: weights compared at 10% of lr."""
    _, ranks, _ = job
    assert max_diff(ranks[0]["packed_w2"], ranks[1]["packed_w2"]) == 0.0
    for r in ranks:
        assert max_diff(r["packed_w2"], r["w2"]) <= 1e-5
        for got, want in zip(r["packed_lp0"], r["lp0"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        for got, want in zip(r["packed_metrics"], r["metrics"]):
            assert got["microbatches"] <= want["microbatches"]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-5)


def test_per_sample_outputs_match_local_trainer(job):
    _, ranks, ref = job
    for key in ("lp0", "ref0", "v0", "lp2"):
        for got0, got1, want in zip(ranks[0][key], ranks[1][key], ref[key]):
            assert torch.equal(got0, got1)
            assert got0.dtype == torch.float32 and got0.shape == want.shape
            torch.testing.assert_close(got0, want, atol=1e-5, rtol=0)
    assert ranks[0]["bf16"] == ["torch.bfloat16"]


def test_bf16_linear_weights_match_the_local_trainers_copy(job):
    """param_dtype=bfloat16: the ranks gather the linear weights in bf16 and keep norms, embeddings
    and the head in float32 under autocast, which is what LocalTrainer's bf16 copy computes."""
    _, ranks, ref = job
    for key in ("half_lp0", "half_lp1"):
        for got0, got1, want in zip(ranks[0][key], ranks[1][key], ref[key]):
            assert torch.equal(got0, got1)
            torch.testing.assert_close(got0, want, atol=1e-5, rtol=0)
    assert ranks[0]["half_m"]["loss"] == pytest.approx(ref["half_m"]["loss"], rel=1e-4, abs=1e-6)
    assert max_diff(ranks[0]["half_w"], ref["half_w"]) <= 1e-6
    assert max_diff(ranks[0]["half_w"], ranks[1]["half_w"]) == 0.0


def test_bf16_ranks_keep_norm_weights_whole_and_train_resume_like_the_local_trainer(job):
    """The layers' norm weights are not sharded (float32 on every rank, gradients summed by one
    all-reduce): a second step, with clipping over both kinds of gradient and AdamW state on
    both, matches LocalTrainer, and a resumed sharded checkpoint continues exactly."""
    _, ranks, ref = job
    whole = ranks[0]["half_whole"]
    assert whole and all(n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")) for n in whole)
    assert ref["half_m"]["grad_norm"] > HALF["max_grad_norm"] and ref["half_m2"]["grad_norm"] > HALF["max_grad_norm"]
    assert ranks[0]["half_m2"]["grad_norm"] == pytest.approx(ref["half_m2"]["grad_norm"], rel=1e-4)
    # Each rank rounds its partial gradient of a bf16 linear weight to bf16 before the sum,
    # LocalTrainer the whole batch's (about one bf16 step apart). AdamW's first steps hardly
    # see it (their updates are near +-lr), later ones do: 2.5e-5 after four steps here,
    # against the 1e-3 a wrong or missing gradient moves a weight.
    assert max_diff(ranks[0]["half_w2"], ref["half_w2"]) <= 1e-4
    assert max_diff(ranks[0]["half_w2"], ranks[1]["half_w2"]) == 0.0
    assert max_diff(ranks[0]["half_w2"], ranks[0]["half_w"]) > 1e-5  # the second step moved them
    for res in ranks:
        assert max_diff(res["half_w2b"], res["half_w2"]) == 0.0
    critic = {k: v for k, v in ranks[0]["hc_w"].items() if k.startswith("critic.")}
    assert any("layernorm" in k for k in critic)
    assert max_diff(critic, {k: ref["hc_w"][k] for k in critic}) <= 1e-6
    assert max_diff(ranks[0]["hc_w"], ranks[1]["hc_w"]) == 0.0
    assert ranks[0]["hc_m"]["critic_grad_norm"] == pytest.approx(ref["hc_m"]["critic_grad_norm"], rel=1e-4)


def test_resume_continues_exactly(job):
    _, ranks, _ = job
    for res in ranks:
        assert res["extra"] == {"again": True, "cursor": 2} and res["step_loaded"] == 2
        assert res["m3b"]["loss"] == res["m3"]["loss"] and res["m3b"]["lr"] == res["m3"]["lr"]
        assert max_diff(res["w3b"], res["w3"]) == 0.0


def test_nan_on_one_rank_raises_on_every_rank_and_takes_no_step(job):
    _, ranks, _ = job
    for res in ranks:
        kind, message = res["nan_error"]
        assert kind == "NonFiniteLossError"
        assert "trainer step 3, epoch 0, mini-batch 0, micro-batch 1: loss is nan on rank(s) [1]" in message
        assert res["step_after_nan"] == 3
        assert max_diff(res["w_after_nan"], res["w3b"]) == 0.0
        # No gradient of the failed mini-batch lingers: the next step is the undisturbed one.
        assert max_diff(res["w4b"], res["w4"]) == 0.0


def test_replicated_ranks_match_the_local_trainer(job):
    """trainer.parallel=replicate: the ranks deal the samples as the FSDP ranks do and sum the same
    per-rank gradients (one all-reduce instead of a reduce-scatter), so the local trainer's numbers
    hold to the bound the sharded ranks meet; every rank holds the same weights."""
    _, ranks, ref = job
    assert max_diff(ranks[0]["rep_w2"], ranks[1]["rep_w2"]) == 0.0
    assert max_diff(ranks[0]["rep_w2"], ref["w2"]) <= 1e-6
    assert max_diff(ranks[0]["rep_w3"], ref["w3"]) <= 1e-6
    assert max_diff(ranks[0]["rep_w3"], ranks[0]["rep_w2"]) > 1e-5  # the third step moved the weights
    for got0, got1, want in zip(ranks[0]["rep_metrics"], ranks[1]["rep_metrics"], ref["metrics"]):
        assert got0 == got1  # identical on every rank, time_s included
        assert got0.keys() == want.keys()
        assert got0["microbatches"] == 7.0  # each rank's own plan, as the sharded ranks plan
        assert (got0["num_tokens"], got0["num_seqs"], got0["lr"]) == (want["num_tokens"], 8.0, want["lr"])
        for key in sorted(set(want) - {"microbatches", "num_tokens", "num_seqs", "lr", "time_s"}):
            assert got0[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for key in ("lp0", "ref0", "v0"):
        for got0, got1, want in zip(ranks[0][f"rep_{key}"], ranks[1][f"rep_{key}"], ref[key]):
            assert torch.equal(got0, got1)
            torch.testing.assert_close(got0, want, atol=1e-5, rtol=0)


def test_ranks_with_shared_prompts_match_the_local_trainer(job):
    """pack_sequences=shared on ranks: each rank is dealt whole prompts (two of the four here) and
    computes each once; the numbers are the local trainer's, which shares all four, to float32
    rounding (weights at 10% of lr after two Adam steps, as the packed ranks)."""
    _, ranks, ref = job
    for key in ("fsdp", "rep"):
        assert max_diff(ranks[0][f"shared_{key}_w"], ranks[1][f"shared_{key}_w"]) == 0.0
        assert max_diff(ranks[0][f"shared_{key}_w"], ref["shared_w"]) <= 1e-5
        assert max_diff(ranks[0][f"shared_{key}_w"], ranks[0]["w2"]) > 1e-5  # other batches, other weights
        for got, want in zip(ranks[0][f"shared_{key}_m"], ref["shared_m"]):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-5)
            assert got["num_tokens"] == want["num_tokens"]


def test_replicated_ranks_resume_and_survive_a_nan_on_one_rank(job):
    _, ranks, _ = job
    for res in ranks:
        assert res["rep_extra"] == {"cursor": 2} and res["rep_step_loaded"] == 2
        assert res["rep_m3b"]["loss"] == res["rep_m3"]["loss"]
        assert max_diff(res["rep_w3b"], res["rep_w3"]) == 0.0
        kind, message = res["rep_nan_error"]
        assert kind == "NonFiniteLossError"
        assert "trainer step 3, epoch 0, mini-batch 0: loss is nan on rank(s) [1]" in message
        assert res["rep_step_after_nan"] == 3 and max_diff(res["rep_w_after_nan"], res["rep_w3b"]) == 0.0
        assert max_diff(res["rep_w4b"], res["rep_w4"]) == 0.0  # no gradient of the failed step lingers
    work = job[0]
    from safetensors.torch import load_file
    exported = load_file(str(work / "rep_hf" / "model.safetensors"))
    policy = {k[len("policy."):]: v for k, v in ranks[0]["rep_w3"].items() if k.startswith("policy.")}
    assert exported.keys() <= policy.keys() and all(torch.equal(exported[k], policy[k]) for k in exported)


def test_checkpoint_layout_and_both_exports(job, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conveyor.trainer import checkpoint
    from conveyor.trainer.single import LocalTrainer

    work, ranks, _ = job
    ckpt = work / "ckpt"
    assert not [p.name for p in work.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    assert {"dcp", "rng", "policy", "training_state.pt", "extra.json", "fsdp.json"} <= {p.name for p in ckpt.iterdir()}
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    assert json.loads((ckpt / "fsdp.json").read_text())["world_size"] == 2
    assert (ckpt / "policy" / "tokenizer.json").is_file()

    policy = {k[len("policy."):]: v for k, v in ranks[0]["w2"].items() if k.startswith("policy.")}
    # export_hf here runs in the pytest process, where no process group exists.
    offline = checkpoint.export_hf(ckpt, tmp_path / "offline")
    for out in (work / "hf", offline):
        model = AutoModelForCausalLM.from_pretrained(out)
        assert type(model).__name__ == "LlamaForCausalLM"
        assert max_diff(model.state_dict(), policy) == 0.0
        tok = AutoTokenizer.from_pretrained(out)
        assert tok.decode(tok("12+3=")["input_ids"]) == "12+3="
    with pytest.raises(ValueError, match="sharded"):
        LocalTrainer(offline, TrainerConfig(device="cpu"), total_steps=1).load(ckpt)


def test_needs_a_process_group(tiny_dir):
    from conveyor.trainer.fsdp import FSDPTrainer, balance

    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        FSDPTrainer(tiny_dir, TrainerConfig(device="cpu"), total_steps=1)
    assert balance([20, 3, 4, 5], 2) == [[0], [3, 2, 1]]
    assert balance([3], 2) == [[0], []]


def test_shared_prompts_are_dealt_a_group_to_a_rank():
    """With prompt keys (pack_sequences: shared) a prompt's samples go to one rank, costing the
    prompt once: prompt A (5 tokens) with completions of 4, 1, 2 costs 12, B (2 tokens) with 3, 3, 3
    costs 11, C (6 tokens) with 1 costs 7. Fewer prompts than ranks: dealt sample by sample."""
    from conveyor.trainer.microbatch import balance

    a, b, c = (b"a", 5), (b"b", 2), (b"c", 6)
    lengths, keys = [9, 5, 5, 6, 7, 5, 7], [a, b, b, a, a, b, c]
    assert balance(lengths, 2, keys) == [[0, 3, 4], [1, 2, 5, 6]]
    assert balance(lengths, 3, keys) == [[0, 3, 4], [1, 2, 5], [6]]
    groups = [[i for i in range(len(keys)) if keys[i] == k] for k in (a, b, c)]
    for world in (2, 3):
        shares = balance(lengths, world, keys)
        assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
        assert all(any(set(g) <= set(s) for s in shares) for g in groups)
    assert balance(lengths, 4, keys) == balance(lengths, 4)  # 3 prompts, 4 ranks: per sample


if __name__ == "__main__":
    worker(int(sys.argv[1]), Path(sys.argv[2]))


@pytest.mark.parametrize("world", [2, 3, 8])
def test_bucketed_gather_layout_reassembles_uneven_shards(world):
    """What named_weights' one all-gather per bucket carries: each rank's torch.chunk share of
    dim 0 (fewer rows, or none, on later ranks), padded and packed; unpacked, the full tensors."""
    from conveyor.trainer.fsdp import _buckets, _pack, _unpack

    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(7, 3, generator=gen), torch.randn(5, generator=gen), torch.randn(2, 2, 2, generator=gen),
            torch.randn(world * 2, 1, generator=gen)]
    shapes = [tuple(t.shape) for t in full]
    per_rank = []
    for r in range(world):
        local = [list(t.chunk(world))[r] if r < len(t.chunk(world)) else t[:0] for t in full]
        per_rank.append(_pack(local, shapes, world))
    assert len({p.numel() for p in per_rank}) == 1  # equal sizes, as an all-gather needs
    back = _unpack(torch.stack(per_rank), shapes)
    for a, b in zip(back, full):
        assert a.shape == b.shape and a.is_contiguous() and torch.equal(a, b)
    # Cast while packing (bf16 engines): the same values as casting the full tensors.
    halves = [_pack([list(t.chunk(world))[r] if r < len(t.chunk(world)) else t[:0] for t in full], shapes, world,
                    torch.bfloat16) for r in range(world)]
    for a, b in zip(_unpack(torch.stack(halves), shapes), full):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))
    groups = list(_buckets(full, torch.float32, cap_bytes=4 * 30, world=world))
    assert [t for g in groups for t in g] == full and len(groups) > 1
