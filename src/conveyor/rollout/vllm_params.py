"""How conveyor's sampling contract maps onto vLLM-style engines (in-process and over HTTP).

Contract: pure functions shared by ``rollout.vllm`` and ``rollout.remote``:
(prompt checks and completion budgets are ``rollout.api.capped_budgets``,
shared with the native engine)
- ``sample_seed`` gives each prompt its own seed so that vLLM's per-child
  ``seed + index`` never repeats a stream across the prompts of one call.
- ``versions_from_spans`` expands vLLM's weight-version spans into one int per
  token.
- ``warn_if_truncated`` explains, once, that with top-k / top-p truncation
  vLLM reports the logprob of the truncated distribution.
- ``finish_reason`` maps an engine's finish reason onto conveyor's three.

It knows nothing of HTTP, of vLLM's Python objects or of models: plain values in,
plain values out, so both engines behave the same and are tested once.
"""
from __future__ import annotations

import logging
from typing import Iterable

from conveyor.rollout.api import FinishReason, SamplingParams

log = logging.getLogger("conveyor")
_warned_truncation = False


def sample_seed(seed: int | None, prompt_index: int, n: int) -> int | None:
    """Base seed of one prompt's request; vLLM gives its j-th child ``base + j``. Prompt i of a
    call seeded s gets the seeds of prompt 0 of a call seeded s + i (the native engine's rule),
    and no two (seed + prompt, child) pairs share one."""
    return None if seed is None else (int(seed) + prompt_index) * n


def versions_from_spans(spans, length: int, default: int) -> list[int]:
    """One version per token from ``[(version, start, end), ...]`` spans; ``default`` fills gaps.

    A span label that is not an integer (vLLM's initial label is "default") counts as ``default``.
    """
    out = [default] * length
    for span in spans or ():
        version, start, end = (span.version, span.start, span.end) if hasattr(span, "version") else (
            span["version"], span["start"], span["end"])
        try:
            value = int(version)
        except (TypeError, ValueError):
            value = default
        for k in range(max(0, int(start)), min(length, int(end))):
            out[k] = value
    return out


def warn_if_truncated(params: SamplingParams, engine: str) -> None:
    """vLLM has no mode for 'temperature-scaled, before top-k/top-p': say so once."""
    global _warned_truncation
    if _warned_truncation or params.temperature == 0 or (params.top_k == 0 and params.top_p >= 1.0):
        return
    _warned_truncation = True
    log.warning("%s: with top_k/top_p truncation vLLM reports logprobs of the truncated, renormalised "
                "distribution (higher than the trainer's log_softmax(logits/T) by log of the kept mass); "
                "set rollout.top_k=0 and rollout.top_p=1 for exact behaviour logprobs", engine)


def finish_reason(reason: str | None) -> FinishReason:
    if reason in ("stop", "length", "abort"):
        return reason  # type: ignore[return-value]
    # Anything else (None on an unfinished output, a server's own words) means it did not finish normally.
    return "abort"


def eos_logit_bias(eos_ids: Iterable[int], eos_bias: float) -> dict[int, float] | None:
    """vLLM adds ``logit_bias`` before temperature, as the native sampler adds ``eos_bias``."""
    if not eos_bias:
        return None
    ids = sorted(set(int(i) for i in eos_ids))
    if not ids:
        raise ValueError("SamplingParams.eos_bias needs an EOS token; the model config and tokenizer define none")
    return {i: float(eos_bias) for i in ids}
