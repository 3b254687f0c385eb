"""The native engine's generation loop over the paged fast runner.

Contract
- ``PagedLoop(engine, params, stop, generator).run(requests, feed, on_finish)``
  fills every request's tokens, logprobs, versions and finish reason (the same
  contract as the dense loop in ``engine.py``). Each iteration: take new
  requests from ``feed()`` (optional; called outside the engine's lock, so a
  weight update may land there) onto the back of the waiting queue; admit a
  wave that the KV pool can take (FIFO, ``Scheduler.admit(fits)``), prefill it
  and sample each admitted request's first token; then make room for the
  running batch's next tokens (preempting the most recently admitted requests
  when the pool is full; they go back to the front of the queue and are
  recomputed on re-admission), decode one token for every running request and
  sample. Finished requests free their blocks at once and are handed to
  ``on_finish(requests)`` (optional; outside the lock), each exactly once.
  ``run`` returns when nothing is waiting or running and ``feed()`` gave
  nothing: that is continuous batching, new requests join a batch that is
  still decoding instead of waiting for its longest sequence.
- The caller keeps ``prompt_index`` unique per prompt within one ``run``: the
  runner shares prompt KV blocks among requests of the same index.
- Sampling: plain temperature or greedy sampling on the GPU uses the fused
  one-pass sampler (``triton_ops.sample_plain``: same distribution and logprob,
  a different random stream); top-k / top-p and the CPU use ``sampling.sample``.
- One host synchronisation per step: the sampled tokens and their float32
  logprobs come back to the host together.
- A step holds the engine's lock while it queues the forward (prefill or
  decode) and records the version at its start; it samples and waits for the
  GPU after releasing it. A weight update from another thread (or from
  ``feed``) therefore lands between two steps' forwards: on CUDA its copy is
  queued on the same stream after this step's kernels and before the next.
- ``engine.counters`` adds up decode steps, the rows they decoded, and the host's
  seconds in decode steps (queueing, GPU, sampled tokens back) and in admissions
  (prefill and first tokens): what an engine's step costs in a run.
- ``engine.pause()`` stops scheduling between steps (the KV blocks stay);
  ``engine.resume()`` continues; ``engine.abort()`` ends the call: unfinished
  requests (running or still waiting) get finish_reason "abort" with the
  tokens they have; they are not passed to ``on_finish``.

It knows nothing of model internals or KV layout (the runner owns those), nor
of chunks or callers: requests in, finished requests out.
"""
from __future__ import annotations

import time
from typing import Callable

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
        self.counters = engine.counters
        self.eos = tuple(sorted(engine.eos_ids))
        # The fused one-pass sampler covers plain temperature / greedy sampling on the GPU;
        # top-k / top-p keep the reference sampler (a sort over the vocabulary).
        fused = getattr(self.runner.ops, "sample_plain", None)
        self.fused = fused if fused is not None and params.top_k == 0 and params.top_p >= 1.0 else None
        self.eos_t = torch.tensor(self.eos or (0,), dtype=torch.long, device=self.runner.device)

    def run(self, requests: list[Request], feed: Callable[[], list[Request]] | None = None,
            on_finish: Callable[[list[Request]], None] | None = None) -> None:
        sched = Scheduler(requests, self.engine.max_batch, self.engine.refill)
        self.on_finish = on_finish
        try:
            while True:
                if feed is not None:
                    sched.waiting.extend(feed())
                if not sched.has_work():
                    break
                if not self.engine._wait_unpaused():
                    break  # aborted
                admitted = sched.admit(self.runner.admission_check(sched.running))
                if admitted:
                    t0 = time.perf_counter()
                    with self.engine._lock:
                        version = self.engine.version
                        logits = self.runner.prefill(admitted)
                    self._sample(admitted, logits, version)
                    self.counters["prefill_s"] += time.perf_counter() - t0
                    self._retire(sched)
                if sched.running:
                    self._decode(sched)
                elif not admitted and sched.waiting:
                    raise RuntimeError("fast runner: no request could be admitted into an empty KV pool")
        finally:
            # Only unfinished requests are left here (finished ones were freed on retirement),
            # so a long streaming call does not keep every request it ever served.
            for r in [*sched.running, *sched.waiting]:
                self.runner.free(r)
                if r.finish_reason is None:
                    r.finish_reason = "abort"

    def _decode(self, sched: Scheduler) -> None:
        t0 = time.perf_counter()
        with self.engine._lock:
            version = self.engine.version
            sched.preempt(self.runner.ensure_slots(sched.running))
            if not sched.running:
                return
            logits = self.runner.decode(sched.running)
        # Sampling reads only the logits, so the lock is free while the host waits for this
        # step: a weight copy queued meanwhile runs after the step's kernels, before the next.
        self._sample(sched.running, logits, version)
        c = self.counters
        c["decode_s"] += time.perf_counter() - t0
        c["decode_steps"] += 1
        c["decode_rows"] += len(sched.running)
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
        done = [r for r in sched.running if r.finished]
        for r in done:
            self.runner.free(r)
        sched.retire()
        if done and self.on_finish is not None:
            self.on_finish(done)
