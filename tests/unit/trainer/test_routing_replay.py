"""Mixture-of-experts models: the engine records each token's experts, the trainer replays them.

A tiny Qwen3-MoE model (8 experts, top 2) built locally. The engine at float32 and the
trainer at float32 compute the same numbers up to summation order, so their routers agree
wherever the k-th and (k+1)-th router probabilities are apart by more than that rounding
(float32 eps times a few, 1e-5 here); with replay the trainer computes the engine's logprobs
to float32 rounding, and a forced disagreement is followed exactly.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from conveyor import routing
from conveyor.config import TrainerConfig
from conveyor.controller.objective import base_batch
from conveyor.data.tiny import build_model
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native.engine import NativeEngine
from conveyor.rollout.single_turn import to_groups
from conveyor.trainer.single import LocalTrainer
from conveyor.types import Batch, Task

MOE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
       "max_position_embeddings": 64, "num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 32}
PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51]]
FP32_TIE = 1e-5  # router probabilities closer than this may order differently across two float32 forwards


@pytest.fixture(scope="module")
def moe(tokenizer):
    return build_model(tokenizer, seed=3, **MOE)


@pytest.fixture(scope="module")
def rollout(moe, tokenizer):
    """Engine completions at float32 with recorded experts, as trajectories."""
    engine = NativeEngine(copy.deepcopy(moe), tokenizer, device="cpu", dtype="float32", record_experts=True)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=2, seed=1))
    tasks = [Task(str(i), "") for i in range(len(PROMPTS))]
    trajs = [t for g in to_groups(tokenizer, tasks, [tuple(p) for p in PROMPTS], outs, 0.0) for t in g.trajectories]
    return outs, trajs


def _trainer(moe) -> LocalTrainer:
    return LocalTrainer(copy.deepcopy(moe), TrainerConfig(device="cpu", lr=1e-3), total_steps=10)


def test_engine_records_one_row_of_experts_per_fed_token(rollout):
    outs, trajs = rollout
    for prompt, samples in zip(PROMPTS, outs):
        for c in samples:
            r = c.routed_experts
            assert r.shape == (len(prompt) + len(c.token_ids) - 1, MOE["num_layers"], MOE["experts_per_token"])
            assert r.min() >= 0 and r.max() < MOE["num_experts"]
            assert all(len(set(row)) == MOE["experts_per_token"] for row in r.reshape(-1, 2).tolist())
        # the samples of a prompt share its prefill, so their prompt experts are identical
        assert np.array_equal(samples[0].routed_experts[:len(prompt)], samples[1].routed_experts[:len(prompt)])
    assert all(t.routed_experts is not None for t in trajs)


def _router_margins(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Own experts [T, layers, k] of a full forward over ``ids`` and the gap between the k-th and
    (k+1)-th router probability per token and layer."""
    gaps = []
    hooks = [r.register_forward_hook(lambda m, a, out: gaps.append(
        torch.softmax(out[0].float(), -1).topk(m.top_k + 1, -1).values.diff(dim=-1)[:, -1].abs()))
        for r in routing.routers(model)]
    try:
        with torch.no_grad():
            _, own = routing.own_routes(model, lambda: model(ids[None]))
    finally:
        for h in hooks:
            h.remove()
    return own, torch.stack(gaps, dim=1)


def test_recorded_experts_are_the_routers_choice(moe, rollout):
    """A full forward of prompt + completion routes every clearly decided token as recorded."""
    _, trajs = rollout
    decided = 0
    for t in trajs:
        ids = torch.tensor(t.prompt_ids + t.completion_ids)
        own, gap = _router_margins(moe, ids)
        rec = torch.from_numpy(t.routed_experts).long()
        clear = gap[: len(rec)] > FP32_TIE
        same = (own[: len(rec)].sort(-1).values == rec.sort(-1).values).all(-1)
        assert bool(same[clear].all())
        decided += int(clear.sum())
    assert decided > 0.9 * sum(len(t.routed_experts) * MOE["num_layers"] for t in trajs)


def test_replay_gives_the_engines_logprobs_at_fp32(moe, rollout):
    _, trajs = rollout
    batch = base_batch(trajs)
    assert batch.routes is not None
    lps = _trainer(moe).logprobs(batch)
    for t, lp in zip(trajs, lps):
        got = lp[len(t.prompt_ids):]
        want = torch.tensor(t.logprobs)
        # float32 forwards of different batch shapes: differences of a few 1e-6 on logprobs of size ~4
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_replay_follows_a_forced_disagreement(moe, rollout):
    """Routes that name other experts than the router would pick are used exactly, and change logprobs."""
    _, trajs = rollout
    t = trajs[0]
    ids = torch.tensor(t.prompt_ids + t.completion_ids)
    own, _ = _router_margins(moe, ids)
    n = len(t.routed_experts)
    # the lowest-numbered experts the token's own router did not choose
    free = torch.ones(n, MOE["num_layers"], MOE["num_experts"]).scatter_(-1, own[:n], 0.0)
    forced = (free * (MOE["num_experts"] - torch.arange(MOE["num_experts"]))).topk(2, dim=-1).indices
    assert not bool((forced[..., :, None] == own[:n, :, None, :]).any())
    forced[0] = -1  # a row with no record keeps the router's own choice
    trainer = _trainer(moe)
    batch = base_batch([t])
    plain = trainer.logprobs(Batch(batch.input_ids, batch.loss_mask))[0]  # the router's own choice
    batch.routes[0] = forced
    taps = routing.RouterTaps.of(trainer.compute)
    taps.start_recording()
    replayed = trainer.logprobs(batch)[0]
    used = taps.take().view(len(ids), MOE["num_layers"], 2)
    taps.stop_recording()
    assert torch.equal(used[1:n], forced[1:])
    # unrecorded: the first token (no earlier token's experts changed it), and the last token's
    # first layer (later layers see the forced tokens through attention)
    assert torch.equal(used[0], own[0]) and torch.equal(used[n:, 0], own[n:, 0])
    assert (replayed[2:] - plain[2:]).abs().max() > 1e-3
    # every forced first-layer decision overrode the router: at least half of all replayed ones
    assert routing.replay_differs(trainer.compute) >= 0.5


def test_replay_gradient_reaches_the_router(moe, rollout):
    """The recorded experts' weights come from the router's softmax, so the router learns under replay."""
    _, trajs = rollout
    trainer = _trainer(moe)
    batch = base_batch(trajs)
    batch.fields["adv"] = [torch.ones(len(x)) for x in batch.input_ids]

    def loss(out, mb, num_tokens, num_seqs):
        return -(out["logprobs"] * mb["adv"] * mb["loss_mask"]).sum() / num_tokens, {}

    before = [r.weight.detach().clone() for r in routing.routers(trainer.model)]
    metrics = trainer.train(batch, loss)
    after = [r.weight.detach() for r in routing.routers(trainer.model)]
    assert 0.0 <= metrics["routing_replay_differs"] < 0.1  # float32 on both sides: near-ties only
    assert all((a - b).abs().max() > 0 for a, b in zip(after, before))


def test_checkpointed_backward_replays_the_same_experts(moe, rollout):
    """Gradient checkpointing re-runs each layer's forward in backward: with replay it must route
    as the forward did, so one step with and one without checkpointing move the weights alike."""
    _, trajs = rollout
    base = base_batch(trajs[:2])
    # another expert set than the record everywhere, so a recompute on the router's own choice shows
    batch = Batch(base.input_ids, base.loss_mask, {"adv": [torch.linspace(-1, 1, len(x)) for x in base.input_ids]},
                  [(r + 1) % MOE["num_experts"] for r in base.routes])

    def loss(out, mb, num_tokens, num_seqs):
        return -(out["logprobs"] * mb["adv"] * mb["loss_mask"]).sum() / num_tokens, {}

    weights = []
    for checkpointing in (False, True):
        cfg = TrainerConfig(device="cpu", lr=1e-2, gradient_checkpointing=checkpointing)
        trainer = LocalTrainer(copy.deepcopy(moe), cfg, total_steps=10)
        trainer.train(batch, loss)
        weights.append(dict(trainer.model.named_parameters()))
    for name, w in weights[0].items():
        # the same float32 operations in the same order: equal up to a few ulps
        torch.testing.assert_close(weights[1][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_fast_runner_leaves_moe_models_to_the_hf_runner(moe, tokenizer, caplog):
    """The paged fast runner has no expert layers: asked for it, the engine logs why and runs the
    Hugging Face forward, which is the one that records experts."""
    with caplog.at_level("WARNING"):
        engine = NativeEngine(copy.deepcopy(moe), tokenizer, device="cpu", dtype="float32", runner="fast")
    assert not engine.paged and "qwen3_moe" in caplog.text
    out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3, seed=0))
    assert len(out[0][0].token_ids) == 3 and out[0][0].routed_experts is None  # recording is opt-in


def test_replay_refuses_routes_of_another_shape(moe):
    with pytest.raises(ValueError, match="expected \\[batch, tokens, 2, 2\\]"):
        routing.RouterTaps.of(copy.deepcopy(moe)).replay(torch.zeros(1, 4, 3, 2, dtype=torch.long))


def test_dense_model_has_no_routers(tokenizer):
    dense = build_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    assert routing.moe_shape(dense) is None
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        routing.RouterTaps.of(dense)


def test_run_refuses_replay_on_a_dense_checkpoint(tmp_path):
    from conveyor.data.tiny import build_tiny
    from conveyor.run.session import SetupError, _check_moe
    dense = build_tiny(tmp_path / "dense", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64)
    with pytest.raises(SetupError, match="algo.routing_replay needs a mixture-of-experts model"):
        _check_moe(str(dense))
    _check_moe(str(build_tiny(tmp_path / "moe", **MOE)))


def test_config_refuses_replay_without_experts():
    from conveyor.config import RunConfig
    with pytest.raises(ValueError, match="model.tiny.num_experts"):
        RunConfig.model_validate({"algo": {"routing_replay": True}})
    with pytest.raises(ValueError, match="rollout.runner=auto or hf"):
        RunConfig.model_validate({"algo": {"routing_replay": True}, "model": {"tiny": {"num_experts": 4}},
                                  "rollout": {"runner": "fast"}})
    cfg = RunConfig.model_validate({"algo": {"routing_replay": True}, "model": {"tiny": {"num_experts": 4}}})
    assert cfg.rollout.record_experts


FAST = ["sft.steps=0", "loop.batch_size=2", "rollout.n=4", "data.eval_size=4", "loop.steps=2",
        "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.tiny.num_experts=4", "model.tiny.experts_per_token=2", "model.tiny.moe_intermediate_size=32",
        "loop.time_limit_s=null", "loop.eval_every=0", "observe.tensorboard=false", "observe.progress=false",
        "rollout.dtype=bfloat16",
        # An entropy term makes every sample count (none inert, trainer/single.py), so every step runs
        # the forward that replays the routes, whatever rewards the untrained model earns.
        "algo.entropy_coef=0.001"]


@pytest.mark.parametrize("replay", [True, False])
def test_rl_steps_with_an_moe_model(tmp_path, replay):
    from conveyor.cli import main
    run = tmp_path / "run"
    assert main(["train", f"--output-dir={run}", *FAST, f"algo.routing_replay={str(replay).lower()}"]) == 0
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 2
    assert routing.config_moe_shape(AutoConfig.from_pretrained(run / "base_model")) == routing.MoEShape(2, 2, 4)
    resolved = (run / "config.yaml").read_text()
    assert ("record_experts: true" in resolved) == replay
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    replayed = [m["routing_replay_differs"] for m in train if "routing_replay_differs" in m]
    assert len(replayed) == (2 if replay else 0) and all(0.0 <= x <= 1.0 for x in replayed)
