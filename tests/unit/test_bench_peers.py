"""The benchmark's configs: one RunConfig per workload, and its field-by-field mapping onto TRL's GRPOConfig."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import workloads as W  # noqa: E402


def _spec(tmp_path, workload="w2", **kw):
    spec = {"workload": workload, "system": "conveyor", "name": "x", "run_dir": str(tmp_path / "run"),
            "model_path": str(tmp_path / "model"), "seed": 3, "lr": 2e-3, "budget_s": 90.0, "max_steps": 50,
            "overrides": ["loop.batch_size=4"], "prompts_path": str(tmp_path / "p.jsonl"), "eos_bias": 5.5}
    spec.update(kw)
    return spec


def test_w2_config_pins_what_the_comparison_needs(tmp_path):
    cfg = W.run_config(_spec(tmp_path))
    assert cfg.model.path == str(tmp_path / "model") and cfg.sft.steps == 0
    assert (cfg.trainer.lr, cfg.loop.seed, cfg.loop.time_limit_s, cfg.loop.steps) == (2e-3, 3, 90.0, 50)
    assert cfg.loop.batch_size == 4 and cfg.rollout.n == 8          # user override, recipe default
    assert cfg.reward.fn == "benchmarks.rewards:conveyor_partial_credit"
    assert cfg.reward.kwargs == {"log_path": str(tmp_path / "run" / W.TRAJECTORIES)}
    assert W.samples_per_step(cfg) == 32
    # W2 keeps its task (two-digit addition) whatever the built-in default recipe trains
    assert (cfg.data.source, cfg.data.options) == ("synthetic:addition", {"digits": 2})


def test_w1_config_is_the_protocol_shape(tmp_path):
    cfg = W.run_config(_spec(tmp_path, "w1", overrides=[]))
    assert (cfg.loop.batch_size, cfg.rollout.n, cfg.rollout.max_new_tokens) == (32, 8, 1024)
    assert cfg.rollout.eos_bias == 5.5 and cfg.algo.kl_coef == 0.0 and cfg.algo.clip_low == 0.2
    assert cfg.data.source == "jsonl" and cfg.data.eval_size == 0
    assert cfg.reward.fn == "benchmarks.rewards:conveyor_hash"


def test_trl_arguments_mirror_the_run_config(tmp_path):
    pytest.importorskip("trl")
    from benchmarks.peers.trl_peer import grpo_args
    cfg = W.run_config(_spec(tmp_path, "w1", overrides=[]))
    a = grpo_args(cfg, {"trl_micro_batch": 16}, tmp_path / "trl", cuda=False, eos_id=2, max_steps=7)
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps, a.steps_per_generation) == (16, 16, 16)
    assert a.generation_batch_size == 256 and a.num_generations == 8 and a.max_steps == 7
    assert (a.learning_rate, a.lr_scheduler_type.value, a.warmup_steps, a.weight_decay) == (2e-3, "constant", 0, 0.0)
    assert (a.loss_type, a.scale_rewards, a.beta, a.epsilon, a.epsilon_high) == ("dapo", "group", 0.0, 0.2, 0.2)
    assert a.max_completion_length == 1024 and a.temperature == 1.0 and a.top_k == 0
    assert a.generation_kwargs == {"sequence_bias": [[[2], 5.5]]}
    assert not a.shuffle_dataset and not a.gradient_checkpointing and not a.bf16 and a.max_grad_norm == 1.0


def test_trl_peer_refuses_what_it_cannot_reproduce(tmp_path):
    pytest.importorskip("trl")
    from benchmarks.peers.trl_peer import grpo_args
    cfg = W.run_config(_spec(tmp_path, overrides=["algo.loss=gspo"]))
    with pytest.raises(ValueError, match="algo.loss=gspo"):
        grpo_args(cfg, {}, tmp_path / "trl", cuda=False, eos_id=2, max_steps=1)


def test_w1_tokenizer_round_trips_prompts_through_autotokenizer(tmp_path):
    from transformers import Qwen2Config

    from benchmarks.models import FIRST_WORD_ID, build_word_tokenizer, check_prompt_roundtrip, write_prompts
    # A "qwen2" config makes AutoTokenizer pick Qwen2Tokenizer, which rebuilds the BPE from vocab + merges.
    Qwen2Config(vocab_size=4096).save_pretrained(tmp_path)
    build_word_tokenizer(4096).save_pretrained(tmp_path)
    prompts = write_prompts(tmp_path / "p.jsonl", 3, 24, 4096, seed=1)
    check_prompt_roundtrip(tmp_path, prompts, 24)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 4096 and tok.eos_token_id == 2 and tok.pad_token_id == 0
    assert tok(" ab Cd")["input_ids"][0] >= FIRST_WORD_ID


def test_trl_maps_several_optimizer_steps_per_rollout_batch(tmp_path):
    pytest.importorskip("trl")
    from benchmarks.peers.trl_peer import grpo_args, optimizer_steps_per_rollout_batch
    over = ["loop.batch_size=4", "trainer.mini_batches=4", "trainer.ppo_epochs=2"]
    cfg = W.run_config(_spec(tmp_path, overrides=over))
    assert optimizer_steps_per_rollout_batch(cfg) == 8
    a = grpo_args(cfg, {"trl_micro_batch": 4}, tmp_path / "trl", cuda=False, eos_id=2, max_steps=5)
    # 4 tasks x 8 samples = 32 per batch, 8 per optimizer step, micro-batches of 4
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps, a.steps_per_generation) == (4, 2, 8)
    assert a.generation_batch_size == 32 and a.num_iterations == 2 and a.max_steps == 40
    bad = W.run_config(_spec(tmp_path, overrides=["loop.batch_size=4", "trainer.mini_batches=3"]))
    with pytest.raises(ValueError, match="mini_batches=3 must divide"):
        grpo_args(bad, {}, tmp_path / "trl", cuda=False, eos_id=2, max_steps=1)
