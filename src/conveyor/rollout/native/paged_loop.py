"""The native engine's generation loop over the paged fast runner.

Contract
- ``PagedLoop(engine, params, stop).run(requests, feed, on_finish)``
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
  one-pass sampler (``triton_ops.sample_plain``: same distribution, logprob and
  random numbers); top-k / top-p and the CPU use ``sampling.sample``. Each row
  draws from its request's stream (``Request.key``) at the index of the token
  it draws, so a request's tokens do not depend on its batch.
- One step ahead: a decode step is queued (its input tokens taken on the
  device from the samples of the step before) before the host reads the step
  before's tokens and logprobs (one copy to pinned memory per step), so the
  host's work per row overlaps the device's next step. A request that ends on
  a stop token has been decoded once more; that token is dropped. One that
  ends by length is not decoded again. Admission and preemption first read
  the step in flight (they change KV blocks and rows), as do a pause and the
  end of ``run``.
- A step holds the engine's lock while it queues the forward (prefill or
  decode) and records the version at its start. A weight update from another
  thread (or from ``feed``) therefore lands between two steps' forwards: on
  CUDA its copy is queued on the same stream after the kernels queued so far
  and before the next step's.
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

import numpy as np
import torch

from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native.paged import blocks_for
from conveyor.rollout.native.sampling import draw_seeds, sample
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


class _Step:
    """A decode step queued on the device whose sampled tokens the host has not read yet."""

    def __init__(self, reqs: list[Request], tokens: torch.Tensor, host: torch.Tensor, done, version: int):
        self.reqs, self.tokens, self.host, self.done, self.version = reqs, tokens, host, done, version
        self.index = {id(r): i for i, r in enumerate(reqs)}


class PagedLoop:
    def __init__(self, engine, params: SamplingParams, stop: StopRule):
        self.engine, self.runner, self.params, self.stop = engine, engine.runner, params, stop
        self.counters = engine.counters
        self.eos = tuple(sorted(engine.eos_ids))
        # The fused one-pass sampler covers plain temperature / greedy sampling on the GPU;
        # top-k / top-p keep the reference sampler (a sort over the vocabulary).
        fused = getattr(self.runner.ops, "sample_plain", None)
        self.fused = fused if fused is not None and params.top_k == 0 and params.top_p >= 1.0 else None
        self.eos_t = torch.tensor(self.eos or (0,), dtype=torch.long, device=self.runner.device)
        cuda = self.runner.device.type == "cuda"
        # Sampled tokens and logprobs come back through two pinned buffers used in turn; the
        # rows' seeds go out through two more.
        self._out = [torch.zeros(2 * engine.max_batch, dtype=torch.float64, pin_memory=cuda) for _ in range(2)]
        self._seeds = [torch.zeros(engine.max_batch, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._turn = 0
        self.ahead: _Step | None = None  # the decode step in flight

    def run(self, requests: list[Request], feed: Callable[[], list[Request]] | None = None,
            on_finish: Callable[[list[Request]], None] | None = None) -> None:
        sched = Scheduler(requests, self.engine.max_batch, self.engine.refill)
        self.on_finish = on_finish
        failed = True
        try:
            while True:
                if feed is not None:
                    sched.waiting.extend(feed())
                if not sched.has_work():
                    break
                if not self.engine._unpaused.is_set():
                    self._drain(sched)  # a paused engine hands over what it has decoded
                if not self.engine._wait_unpaused():
                    break  # aborted
                admitted = sched.admit(self.runner.admission_check(sched.running))
                if admitted:
                    self._drain(sched)  # the admission's sampling waits for the device anyway
                    t0 = time.perf_counter()
                    with self.engine._lock:
                        version = self.engine.version
                        logits = self.runner.prefill(admitted)
                    self._read(self._launch(admitted, logits, version, [len(r.token_ids) for r in admitted]))
                    self.counters["prefill_s"] += time.perf_counter() - t0
                    self._retire(sched)
                if sched.running:
                    self._decode(sched)
                elif not admitted and sched.waiting:
                    raise RuntimeError("fast runner: no request could be admitted into an empty KV pool")
            failed = False
        finally:
            if self.ahead is not None:
                # Its tokens are real (an abort keeps them); after an error only its copies matter.
                step, self.ahead = self.ahead, None
                if failed:
                    _wait(step.done)
                else:
                    self._read(step)
            # Only unfinished requests are left here (finished ones were freed on retirement),
            # so a long streaming call does not keep every request it ever served.
            for r in [*sched.running, *sched.waiting]:
                self.runner.free(r)
                if r.finish_reason is None:
                    r.finish_reason = "abort"

    def _decode(self, sched: Scheduler) -> None:
        """Queue the next decode step, then read the one queued before it: the host's work on
        one step's tokens (stop rules, bookkeeping, the next step's inputs) overlaps the
        device computing the next step instead of leaving it idle."""
        t0 = time.perf_counter()
        if self.ahead is not None and not self.runner.room_for_next_tokens(sched.running):
            self._drain(sched)  # preemption frees KV blocks: only with no step in flight
            if not sched.running:
                return
        prev, nxt = self.ahead, None
        with self.engine._lock:
            version = self.engine.version
            if prev is None:
                sched.preempt(self.runner.ensure_slots(sched.running))
                batch = list(sched.running)
            else:
                # A request whose token in flight is its last (by length) is not decoded again;
                # one that ends on a stop token is, and that token is dropped when read.
                batch = [r for r in sched.running
                         if not (id(r) in prev.index and len(r.token_ids) + 1 >= r.max_new_tokens)]
                self.runner.ensure_slots(batch)  # room was checked: nothing is preempted
            if batch:
                src = None if prev is None else [prev.index.get(id(r), -1) for r in batch]
                logits = self.runner.decode(batch, None if prev is None else prev.tokens, src)
                # The index of the token each row draws counts the one in flight, not read yet.
                drawn = ([len(r.token_ids) for r in batch] if src is None
                         else [len(r.token_ids) + (i >= 0) for r, i in zip(batch, src)])
                nxt = self._launch(batch, logits, version, drawn)
        self.ahead = nxt
        c = self.counters
        if nxt is not None:
            c["decode_steps"] += 1
            c["decode_rows"] += len(batch)
        if prev is not None:
            self._read(prev)
            self._retire(sched)
        c["decode_s"] += time.perf_counter() - t0

    def _drain(self, sched: Scheduler) -> None:
        if self.ahead is not None:
            step, self.ahead = self.ahead, None
            self._read(step)
            self._retire(sched)

    def _launch(self, reqs: list[Request], logits: torch.Tensor, version: int, drawn: list[int]) -> _Step:
        """Sample on the device (row i draws token ``drawn[i]`` of its request's stream) and
        start copying tokens and logprobs to the host."""
        p, n = self.params, len(reqs)
        seeds = None
        if p.temperature > 0:
            staged = self._seeds[self._turn][:n]
            staged.numpy()[:] = draw_seeds([r.key for r in reqs], drawn)
            seeds = staged.to(logits.device, non_blocking=True)
        if self.fused is not None:
            tokens, logprobs = self.fused(logits, temperature=p.temperature, eos_ids=self.eos_t,
                                          eos_bias=p.eos_bias if self.eos else 0.0, seeds=seeds)
        else:
            tokens, logprobs = sample(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                      eos_ids=self.eos, eos_bias=p.eos_bias, seeds=seeds)
        # A contiguous [2, n] block: a strided destination would be filled through a pageable
        # temporary, synchronously.
        host = self._out[self._turn][:2 * n].view(2, n)
        self._turn ^= 1
        # One transfer for both; float64 holds every token id and float32 logprob exactly.
        host.copy_(torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)]), non_blocking=True)
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return _Step(reqs, tokens, host, done, version)

    def _read(self, step: _Step) -> None:
        _wait(step.done)
        both = step.host.numpy()
        toks, lps = both[0].astype(np.int64).tolist(), both[1].tolist()
        for req, tok, lp in zip(step.reqs, toks, lps, strict=True):
            if req.finished:
                continue  # it ended on the step before; this token was decoded ahead of that news
            req.append(tok, lp, step.version)
            req.finish_reason = self.stop.finish_reason(req)

    def _retire(self, sched: Scheduler) -> None:
        done = [r for r in sched.running if r.finished]
        for r in done:
            self.runner.free(r)
        sched.retire()
        if done and self.on_finish is not None:
            self.on_finish(done)


def _wait(done) -> None:
    if done is not None:
        done.synchronize()
