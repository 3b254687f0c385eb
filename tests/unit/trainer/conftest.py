"""Shared fixtures for the trainer tests: a tiny model, batches and losses."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conveyor.data.tiny import build_model, build_tiny, build_tokenizer
from conveyor.types import Batch

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            max_position_embeddings=64)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def make_model(tokenizer):
    """Fresh tiny model; the same seed gives bit-identical weights."""
    def make(seed: int = 0):
        return build_model(tokenizer, seed=seed, **TINY)
    return make


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), **TINY)


@pytest.fixture
def make_batch(tokenizer):
    """Batch of random sequences; the first half of each is prompt (loss_mask 0)."""
    def make(lengths, seed: int = 0, vocab: int | None = None) -> Batch:
        gen = torch.Generator().manual_seed(seed)
        vocab = vocab or len(tokenizer)
        ids, masks, adv, ret = [], [], [], []
        for n in lengths:
            ids.append(torch.randint(7, vocab, (n,), generator=gen))
            mask = torch.zeros(n)
            mask[max(1, n // 2):] = 1.0
            masks.append(mask)
            adv.append(torch.randn(n, generator=gen) * mask)
            ret.append(torch.randn(n, generator=gen) * mask)
        return Batch(ids, masks, {"adv": adv, "returns": ret})
    return make


class PGLoss:
    """Token-mean policy-gradient loss: -sum(adv * logprob * mask) / num_tokens."""

    needs_entropy = False

    def __call__(self, out, mb, num_tokens, num_seqs):
        m = mb["loss_mask"]
        loss = -(mb["adv"] * out["logprobs"] * m).sum() / num_tokens
        mean_lp = float((out["logprobs"].detach() * m).sum() / m.sum().clamp(min=1))
        return loss, {"mean_logprob": mean_lp}


class PGValueLoss(PGLoss):
    """Policy gradient plus a squared-error value loss on the ``returns`` field."""

    def __call__(self, out, mb, num_tokens, num_seqs):
        loss, metrics = super().__call__(out, mb, num_tokens, num_seqs)
        m = mb["loss_mask"]
        vloss = (((out["values"] - mb["returns"]) ** 2) * m).sum() / num_tokens
        return loss + 0.5 * vloss, {**metrics, "value_loss": float(vloss.detach())}


@pytest.fixture
def pg_loss():
    return PGLoss()


@pytest.fixture
def pg_value_loss():
    return PGValueLoss()


@pytest.fixture
def interpreted():
    """Run a check script in a fresh interpreter with TRITON_INTERPRET=1 (Triton's CPU
    interpreter must be chosen before triton is imported); returns its stdout."""
    pytest.importorskip("triton")

    def run(code: str, timeout: float) -> str:
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    return run
