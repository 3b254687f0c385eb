"""The heavy-tail length workload, defined once for every system.

Contract
- The workload: a fixed bias ``b`` is added to the EOS logit so that the
  per-token stop probability is about ``1 / target_mean``; lengths are then
  geometric with that mean, capped at ``max_new_tokens``.
- ``solve_eos_bias(z, p)``: given the unbiased EOS log-odds ``z_i = logit_eos
  - logsumexp(other logits)`` measured at many positions, returns ``b`` with
  ``mean_i sigmoid(z_i + b) = p`` (bisection; adding ``b`` to one logit
  multiplies its odds by ``e^b``, so this is exact per position).
- ``calibrate(model_dir, ...)`` measures ``z`` on the randomly initialised
  model itself (random prompts, every position) and solves for ``b``. Run it
  once per model and hand the same ``b`` to every system
  (``python -m benchmarks.lengths MODEL_DIR --out calib.json`` in a
  subprocess, so the parent never holds GPU memory).
- ``conveyor_overrides(b)`` and ``trl_generation_kwargs(b, eos_id)`` apply it:
  conveyor through ``rollout.eos_bias``; TRL through transformers'
  ``sequence_bias`` (a one-token sequence = a bias on that token's logit,
  applied before temperature, as conveyor does).
- ``length_stats(lengths, cap)``: p50 / p99 / max / mean / tau = max / mean
  and the truncated fraction, nearest-rank percentiles.

What each system's TRAINING logprobs see (both apply the bias only when
sampling): the trainer of each system recomputes log pi on UNBIASED logits.
TRL (num_iterations 1, no vLLM) uses the detached recompute as the PPO
denominator, so its ratio is exactly 1. conveyor uses the engine's
behaviour logprobs, which include the bias, so EOS tokens have ratio
~exp(-b) (clipped when the advantage is negative) and other tokens ratio
~1 + 1/target_mean. Lengths and compute are identical; only the EOS token's
gradient differs. This module does not know how either system trains.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def solve_eos_bias(logodds: list[float], target_p: float, lo: float = -50.0, hi: float = 50.0) -> float:
    """b such that the mean over positions of sigmoid(z_i + b) equals target_p."""
    if not 0.0 < target_p < 1.0:
        raise ValueError(f"target stop probability must be in (0, 1), got {target_p}")
    if not logodds:
        raise ValueError("solve_eos_bias needs at least one measured EOS log-odds value")

    def mean_p(b: float) -> float:
        return sum(_sigmoid(z + b) for z in logodds) / len(logodds)

    for _ in range(100):  # the mean is increasing in b, so bisection converges to 2^-100 of the bracket
        mid = 0.5 * (lo + hi)
        if mean_p(mid) < target_p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def expected_mean_length(p: float, cap: int) -> float:
    """Mean of a geometric length (stop probability p per token, EOS counted) capped at ``cap``."""
    return (1.0 - (1.0 - p) ** cap) / p


def measure_eos_logodds(model, eos_id: int, vocab_low: int, prompt_len: int, batch: int, seed: int,
                        device) -> list[float]:
    """EOS log-odds at every position of ``batch`` random sequences of ``prompt_len`` ids."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab_low, vocab, (batch, prompt_len), generator=gen).to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()                # [B, L, V]
    eos = logits[..., eos_id]                                        # [B, L]
    others = logits.clone()
    others[..., eos_id] = float("-inf")
    z = eos - torch.logsumexp(others, dim=-1)                        # [B, L]
    return [float(v) for v in z.flatten().cpu()]


def calibrate(model_dir: str | Path, target_mean: float, max_new_tokens: int, prompt_len: int = 128,
              batch: int = 8, seed: int = 0, vocab_low: int = 4) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16 if device.type == "cuda"
                                                 else torch.float32).to(device).eval()
    z = measure_eos_logodds(model, tok.eos_token_id, vocab_low, prompt_len, batch, seed, device)
    p = 1.0 / target_mean
    b = solve_eos_bias(z, p)
    p0 = sum(_sigmoid(v) for v in z) / len(z)
    return {"eos_bias": b, "eos_token_id": tok.eos_token_id, "target_stop_p": p, "target_mean": target_mean,
            "unbiased_stop_p_mean": p0, "positions_measured": len(z), "max_new_tokens": max_new_tokens,
            "expected_mean_length": expected_mean_length(p, max_new_tokens),
            "calibration_dtype": str(next(model.parameters()).dtype).replace("torch.", "")}


def conveyor_overrides(eos_bias: float) -> list[str]:
    return [f"rollout.eos_bias={eos_bias!r}"]


def trl_generation_kwargs(eos_bias: float, eos_id: int) -> dict:
    # sequence_bias is a GenerationConfig field, so it survives TRL's generation_kwargs -> GenerationConfig path
    # (a LogitsProcessor object would not: TRL passes no logits_processor to generate()).
    return {"sequence_bias": [[[int(eos_id)], float(eos_bias)]]} if eos_bias else {}


def _rank(sorted_vals: list[float], q: float) -> float:
    k = max(1, math.ceil(q * len(sorted_vals)))
    return float(sorted_vals[k - 1])


def length_stats(lengths: list[int], cap: int | None = None) -> dict:
    """p50 / p99 / max / mean / tau (= max / mean) and the fraction that hit ``cap``."""
    if not lengths:
        return {"count": 0, "p50": None, "p99": None, "max": None, "mean": None, "tau": None,
                "truncated_frac": None}
    s = sorted(lengths)
    mean = sum(s) / len(s)
    return {"count": len(s), "p50": _rank(s, 0.5), "p99": _rank(s, 0.99), "max": float(s[-1]), "mean": mean,
            "tau": s[-1] / mean if mean > 0 else None,
            "truncated_frac": (sum(v >= cap for v in s) / len(s)) if cap else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="calibrate the EOS bias of a model directory")
    p.add_argument("model_dir")
    p.add_argument("--target-mean", type=float, default=256.0)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-low", type=int, default=4, help="smallest id a random prompt may hold")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    res = calibrate(a.model_dir, a.target_mean, a.max_new_tokens, a.prompt_len, a.batch, a.seed, a.vocab_low)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
