"""The native engine's generation loop over the paged fast runner.

Contract
- ``run_paged(engine, requests, params, stop, generator)`` fills every request's
  tokens, logprobs, versions and finish reason (the same contract as the dense
  loop in ``engine.py``). Each iteration: admit a wave that the KV pool can take
  (FIFO, ``Scheduler.admit(fits)``), prefill it and sample each admitted request's
  first token; then make room for the running batch's next tokens (preempting
  the most recently admitted requests when the pool is full; they go back to the
  front of the queue and are recomputed on re-admission), decode one token for
  every running request and sample. Finished requests free their blocks at once.
- Sampling: plain temperature or greedy sampling on the GPU uses the fused
  one-pass sampler (``triton_ops.sample_plain``: same distribution and logprob,
  a different random stream); top-k / top-p and the CPU use ``sampling.sample``.
- One host synchronisation per step: the sampled tokens and their float32
  logprobs come back to the host together.
- A step holds the engine's lock and records the version at its start, so a
  weight update from another thread lands between steps.
- ``engine.pause()`` stops scheduling between steps (the KV blocks stay);
  ``engine.resume()`` continues; ``engine.abort()`` ends the call: unfinished
  requests get finish_reason "abort" with the tokens they have.

It knows nothing of model internals or KV layout: the runner owns those.
"""
from __future__ import annotations

import torch

from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native.paged import blocks_for
from conveyor.rollout.native.sampling import sample
from conveyor.rollout.native.scheduler import Request, Scheduler, StopRule


def check_fits_pool(runner, requests: list[Request]) -> None:
    """Every request must fit the whole pool alone, or it could never finish."""
    cap = runner.allocator.capacity
    for r in requests:
        need = blocks_for(len(r.prompt_ids) + r.max_new_tokens, runner.block_size)
        if need > cap:
            raise ValueError(f"generate: prompt {r.prompt_index} needs up to {need * runner.block_size} tokens of KV "
                             f"cache but the pool holds {cap * runner.block_size}; raise kv_fraction / kv_blocks "
                             f"or lower max_new_tokens")


class PagedLoop:
    def __init__(self, engine, params: SamplingParams, stop: StopRule, gen: torch.Generator):
        self.engine, self.runner, self.params, self.stop, self.gen = engine, engine.runner, params, stop, gen
        self.eos = tuple(sorted(engine.eos_ids))
        # The fused one-pass sampler covers plain temperature / greedy sampling on the GPU;
        # top-k / top-p keep the reference sampler (a sort over the vocabulary).
        fused = getattr(self.runner.ops, "sample_plain", None)
        self.fused = fused if fused is not None and params.top_k == 0 and params.top_p >= 1.0 else None
        self.eos_t = torch.tensor(self.eos or (0,), dtype=torch.long, device=self.runner.device)

    def run(self, requests: list[Request]) -> None:
        sched = Scheduler(requests, self.engine.max_batch, self.engine.refill)
        try:
            while sched.has_work():
                if not self.engine._wait_unpaused():
                    break  # aborted
                admitted = sched.admit(self.runner.admission_check(sched.running))
                if admitted:
                    with self.engine._lock:
                        version = self.engine.version
                        self._sample(admitted, self.runner.prefill(admitted), version)
                    self._retire(sched)
                if sched.running:
                    self._decode(sched)
                elif not admitted and sched.waiting:
                    raise RuntimeError("fast runner: no request could be admitted into an empty KV pool")
        finally:
            for r in requests:
                self.runner.free(r)
                if r.finish_reason is None:
                    r.finish_reason = "abort"

    def _decode(self, sched: Scheduler) -> None:
        with self.engine._lock:
            version = self.engine.version
            sched.preempt(self.runner.ensure_slots(sched.running))
            if not sched.running:
                return
            self._sample(sched.running, self.runner.decode(sched.running), version)
        self._retire(sched)

    def _sample(self, reqs: list[Request], logits: torch.Tensor, version: int) -> None:
        p = self.params
        if self.fused is not None:
            tokens, logprobs = self.fused(logits, temperature=p.temperature, eos_ids=self.eos_t,
                                          eos_bias=p.eos_bias if self.eos else 0.0, generator=self.gen)
        else:
            tokens, logprobs = sample(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                      eos_ids=self.eos, eos_bias=p.eos_bias, generator=self.gen)
        # One transfer for both; float64 holds every token id and float32 logprob exactly.
        both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)]).cpu()
        toks, lps = both[0].long().tolist(), both[1].tolist()
        for req, tok, lp in zip(reqs, toks, lps, strict=True):
            req.append(tok, lp, version)
            req.finish_reason = self.stop.finish_reason(req)

    def _retire(self, sched: Scheduler) -> None:
        for r in sched.running:
            if r.finished:
                self.runner.free(r)
        sched.retire()
