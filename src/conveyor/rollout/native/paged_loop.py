"""The native engine's generation loop over the paged CUDA-graph runner.

Contract: ``PagedLoop(engine, params, stop).run(requests, feed, on_finish)`` fills every
request's tokens, logprobs, versions and finish reason (the contract of ``engine.py``), taking
new requests from ``feed()`` between steps: continuous batching. A step holds the engine's lock
only while it queues its forward, so weight updates land between steps; host and device overlap.
``PagedLoop``'s docstring has the details.

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
from conveyor.transport.messages import rows_key


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
    """Contract: ``PagedLoop(engine, params, stop).run(requests, feed, on_finish)``
    fills every request's tokens, logprobs, versions and finish reason (the
    contract of ``engine.py``). Each iteration takes new requests from ``feed()``
    (outside the engine's lock), admits a FIFO wave the KV pool can take,
    prefills it, makes room for the next tokens (preempting the latest admitted
    when the pool is full; they are recomputed on re-admission) and decodes one
    token per running request; finished requests free their blocks and go to
    ``on_finish`` once each. ``run`` returns when nothing waits or runs and
    ``feed()`` gave nothing: continuous batching. ``prompt_index`` must be unique
    per prompt within a ``run`` (prompt KV blocks are shared by index). A decode
    step is queued before the host reads the step before's tokens, so host and
    device overlap; a step holds the engine's lock only while it queues its
    forward, so weight updates land between steps. ``engine.counters`` adds up
    decode steps, rows and host seconds; ``pause`` / ``resume`` / ``abort`` act
    between steps.
    """
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
                        self.runner.serve_version(version)
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
            rows = None
            if prev is None:
                sched.preempt(self.runner.ensure_slots(sched.running))
                batch = list(sched.running)
            else:
                # A request whose token in flight is its last (by length) is not decoded again;
                # one that ends on a stop token is, and that token is dropped when read.
                batch = [r for r in sched.running
                         if not (len(r.token_ids) + 1 >= r.max_new_tokens and id(r) in prev.index)]
                rows = self.runner.rows_of(batch)
                self.runner.ensure_slots(batch, rows)  # room was checked: nothing is preempted
            if batch:
                src = None if prev is None else [prev.index.get(id(r), -1) for r in batch]
                logits = self.runner.decode(batch, None if prev is None else prev.tokens, src, rows)
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
        spent = time.perf_counter() - t0
        c["decode_s"] += spent
        if nxt is not None:  # by rows, in powers of two: how much of the time few rows were decoded
            key = rows_key(len(batch))
            c[key] = c.get(key, 0.0) + spent

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
        if step.done is not None:  # how long the host waits for the device: the rest of a step is the host's
            t0 = time.perf_counter()
            step.done.synchronize()
            self.counters["device_wait_s"] += time.perf_counter() - t0
        both = step.host.numpy()
        toks, lps = both[0].astype(np.int64).tolist(), both[1].tolist()
        # This runs for every row of every step, and the host's work must hide under the device's
        # step: the appends are inline, and the stop rule is the one call per row.
        rule, version = self.stop.finish_reason, step.version
        for req, tok, lp in zip(step.reqs, toks, lps, strict=True):
            if req.finish_reason is not None:
                continue  # it ended on the step before; this token was decoded ahead of that news
            req.token_ids.append(tok)
            req.logprobs.append(lp)
            req.versions.append(version)
            req.finish_reason = rule(req)

    def _retire(self, sched: Scheduler) -> None:
        done = [r for r in sched.running if r.finish_reason is not None]
        for r in done:
            self.runner.free(r)
        sched.retire()
        if done and self.on_finish is not None:
            self.on_finish(done)


def _wait(done) -> None:
    if done is not None:
        done.synchronize()
