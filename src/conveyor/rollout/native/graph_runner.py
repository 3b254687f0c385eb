"""PagedGraphRunner: paged-KV model runner with CUDA-graph decode for Llama-family decoders.

Contract: a KV pool in the model dtype (``kv_blocks``, or ``kv_fraction`` of
the free GPU memory; a small pool on the CPU) and a ``SeqKV`` per running
request. ``prefill(requests)`` computes every known token's KV and returns
next-token logits in request order (a group's samples share the prompt's full
blocks); ``ensure_slots(running)`` makes room for the next tokens, preempting
the latest admitted when the pool is full; ``decode(running[, last, src])``
feeds each request's last token (possibly still on the device) and returns
logits; ``free(request)`` returns its blocks. Decode is a CUDA graph per batch
bucket over references to the model's parameters, so in-place weight updates
need no recapture. ``release_memory`` / ``reacquire_memory`` give the pool back
and take it again: in place on a GPU (``vmm.py``; graphs kept), else rebuilt.

It knows nothing of sampling, stop rules or versions: the engine's paged loop
(``paged_loop.py``) drives it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from conveyor.rollout.native import vmm
from conveyor.rollout.native.kernels import torch_ops
from conveyor.rollout.native.decoder import PagedDecoder
from conveyor.rollout.native.prefix_cache import PrefixCache
from conveyor.rollout.native.paged import BlockAllocator, blocks_for, kv_bytes_per_token, kv_pool_blocks
from conveyor.rollout.native.runner import context_limit

log = logging.getLogger(__name__)


@dataclass
class SeqKV:
    row: int
    blocks: list[int]
    cached: int
    start: int = 0  # tokens whose KV came from the prefix cache (prefill computes the rest)
    version: int = -1  # the weights version its prefill ran with


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a captured graph: powers of two to 64, then steps of 64, then of 128."""
    sizes, b = [], 1
    while b < 64:
        sizes.append(b)
        b *= 2
    while b < 512:
        sizes.append(b)
        b += 64
    while b < max_batch:
        sizes.append(b)
        b += 128
    return [s for s in sizes if s < max_batch] + [max_batch]


def _select_ops(device: torch.device):
    if device.type != "cuda":
        return torch_ops, False
    try:
        from conveyor.rollout.native.kernels import triton_ops
    except Exception as exc:  # noqa: BLE001 - any import failure means no Triton path
        log.warning("fast runner: Triton is unavailable (%s); using torch kernels without CUDA graphs", exc)
        return torch_ops, False
    return triton_ops, True


class PagedGraphRunner:
    """The fast runner's KV pool, block tables and decode graphs over a model's own parameters.

    - The pool is ``[layers, 2, num_blocks * block_size, kv_heads, head_dim]`` (sized by
      ``paged.kv_pool_blocks``). A ``SeqKV`` holds a row of the persistent block table, its
      block ids (``len(blocks) == ceil(cached / block_size)``) and ``cached``, the tokens whose
      keys and values are in the pool.
    - ``prefill`` covers a prompt plus tokens generated before a preemption and returns
      float32-castable logits ``[len(requests), V]``. Requests with the same prompt and nothing
      generated are computed once: the others share its full blocks (reference counts) and copy
      its last partial block, so they can diverge.
    - ``ensure_slots`` preempts from the end of ``running`` (most recently admitted first) and
      returns those requests: a later ``prefill`` recomputes their KV. ``decode(running, last,
      src)`` reads last tokens sampled by a step the host has not read yet, so a step is queued
      while the one before it runs; ``cached`` then counts that token. ``room_for_next_tokens``
      says whether the next tokens fit without preemption (the loop preempts only with no step
      in flight). ``free`` returns a finished or preempted request's blocks and row.
    - Graph batches are padded to the bucket (``decode_buckets``), padded rows pointing at the
      reserved null block and row; graph inputs are static buffers filled by one host-to-device
      copy per step from two pinned staging buffers used in turn. ``release_memory`` needs no
      request running.
    """

    def __init__(self, model, *, max_batch: int, block_size: int = 16, kv_fraction: float = 0.4,
                 kv_blocks: int | None = None, cuda_graphs: bool = True, prefill_token_budget: int = 16384,
                 prefix_cache: str = "off", quantization: str = "none"):
        self.context_limit = context_limit(model.config)
        self.net = PagedDecoder(model, self.context_limit, quantization)
        self.device, self.dtype = self.net.device, self.net.dtype
        self.ops, graphable = _select_ops(self.device)
        self.use_graphs = bool(cuda_graphs and graphable)
        self.block_size, self.max_batch = int(block_size), int(max_batch)
        self.prefill_token_budget = int(prefill_token_budget)
        self.max_blocks_per_seq = blocks_for(self.context_limit, self.block_size)
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self.bytes_per_block = kv_bytes_per_token(self.net.num_layers, self.net.nkv, self.net.head_dim,
                                                  itemsize) * self.block_size
        self._kv_fraction, self._kv_blocks = kv_fraction, kv_blocks
        self.buckets = decode_buckets(self.max_batch) if self.use_graphs else []
        pin = self.device.type == "cuda"
        # Rows: ids, positions, write slots, context lengths, block-table rows, and where a
        # row's id is on the device (its index in the step before's sampled tokens, or -1).
        # Flat, so that a batch of ``size`` rows is one contiguous [6, size] block (``_rows``):
        # a copy between host and device of a strided slice goes through a pageable temporary
        # and waits for the device, which would undo queueing a step while the one before runs.
        self._inp = torch.zeros(6 * self.max_batch, dtype=torch.long, device=self.device)
        # Two pinned staging buffers, used in turn: a step is queued before the one before it
        # has run, so its inputs must not overwrite that step's while their copy may be pending.
        self._hosts = [torch.zeros(6 * self.max_batch, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        # and for each, a step's new block-table entries (row, column, block): one per row at most
        self._bt_hosts = [torch.zeros(3 * self.max_batch, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.null_row = self.max_batch
        self._bt = torch.zeros(self.max_batch + 1, self.max_blocks_per_seq, dtype=torch.int32, device=self.device)
        self._bt_updates: tuple[list[int], list[int], list[int]] = ([], [], [])
        self._free_rows = list(range(self.max_batch - 1, -1, -1))
        self._cached = np.zeros(self.max_batch + 1, dtype=np.int64)
        self._tail = np.zeros(self.max_batch + 1, dtype=np.int64)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.kv = None
        self._vmm: vmm.VmmBuffer | None = None  # the pool's memory on a GPU, released in place
        self._kv_view: torch.Tensor | None = None
        self._blocks = 0
        self.allocator: BlockAllocator | None = None
        if prefix_cache not in ("off", "version", "stale", "auto"):
            raise ValueError(f"prefix_cache {prefix_cache!r}: choose off, version or stale")
        self._use_prefix = prefix_cache in ("version", "stale")
        # stale: cached KV outlives a weight swap, as a running generation's does with partial rollouts
        self._prefix_stale = prefix_cache == "stale"
        self.prefix: PrefixCache | None = None
        self.prefix_version = -1  # the weights version the cached KV was computed with
        self.reacquire_memory()

    # ----- memory -----------------------------------------------------------------
    def _workspace_bytes(self) -> int:
        """Logits and sampling temporaries of the largest batch plus prefill activations."""
        net = self.net
        ffn = self.net.layers[0].gu_w.shape[0]
        sampling = self.max_batch * net.vocab * (2 + 4 * 4)
        prefill = self.prefill_token_budget * (2 * ffn + 8 * net.hidden) * 4
        return sampling + prefill + (1 << 30)

    def reacquire_memory(self) -> None:
        """Allocate the KV pool (and capture the decode graphs); a no-op when it is held. On a GPU
        with virtual memory management the pool comes back at the same addresses, so the graphs
        captured over it stay valid (``vmm.py``); elsewhere they are captured again."""
        if self.kv is not None:
            return
        if self._vmm is not None:
            torch.cuda.empty_cache()  # what the trainer's allocator keeps cached goes back to the driver
            self._vmm.reacquire()
            self.kv = self._kv_view.zero_()  # no stale bits in rows the graphs read but mask
            self._new_allocator()
            return
        blocks = kv_pool_blocks(device_type=self.device.type, bytes_per_block=self.bytes_per_block,
                                kv_fraction=self._kv_fraction, kv_blocks=self._kv_blocks,
                                workspace_bytes=self._workspace_bytes() if self.device.type == "cuda" else 0)
        net = self.net
        shape = (net.num_layers, 2, blocks * self.block_size, net.nkv, net.head_dim)
        if self.use_graphs and vmm.available(self.device):
            self._vmm = vmm.VmmBuffer(blocks * self.bytes_per_block, self.device)
            self._kv_view = self.kv = self._vmm.tensor(self.dtype, shape).zero_()
        else:
            self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._blocks = blocks
        self._new_allocator()
        log.info("fast runner: KV pool of %d blocks x %d tokens (%.2f GiB%s)", blocks, self.block_size,
                 blocks * self.bytes_per_block / 2**30, ", releasable in place" if self._vmm is not None else "")
        if self.use_graphs:
            self._capture_graphs()

    def _new_allocator(self) -> None:
        self.allocator = BlockAllocator(self._blocks)
        self.prefix = PrefixCache(self.allocator, self.block_size) if self._use_prefix else None

    def release_memory(self) -> None:
        """Free the KV pool (and, without virtual memory management, the graphs' memory);
        ``reacquire_memory`` brings them back."""
        if len(self._free_rows) != self.max_batch:
            raise RuntimeError("release_memory: requests are still running; call it between generate calls")
        self.kv = None
        self.allocator = None
        self.prefix = None
        if self._vmm is not None:
            self._vmm.release()  # the addresses stay: the graphs are kept
            return
        self._graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def holds_memory(self) -> bool:
        return self.kv is not None

    # ----- sequences --------------------------------------------------------------
    @staticmethod
    def share_key(req) -> tuple:
        # Only untouched samples of one prompt have identical tokens; a resumed request is its own.
        return ("prompt", req.prompt_index) if not req.token_ids else ("own", id(req))

    def tokens_of(self, req) -> list[int]:
        return req.prompt_ids + req.token_ids

    def _new_seq(self, blocks: list[int], cached: int) -> SeqKV:
        seq = SeqKV(self._free_rows.pop(), blocks, cached)
        rows, cols, vals = self._bt_updates
        rows.extend([seq.row] * len(blocks))
        cols.extend(range(len(blocks)))
        vals.extend(blocks)
        self._cached[seq.row] = cached
        self._tail[seq.row] = blocks[-1]
        return seq

    def _append_block(self, seq: SeqKV, block: int) -> None:
        seq.blocks.append(block)
        self._bt_updates[0].append(seq.row)
        self._bt_updates[1].append(len(seq.blocks) - 1)
        self._bt_updates[2].append(block)
        self._tail[seq.row] = block

    def serve_version(self, version: int) -> None:
        """The weights version prefills run with from now on: KV cached under another is dropped."""
        if version != self.prefix_version and self.prefix is not None and not self._prefix_stale:
            self.prefix.clear()
        self.prefix_version = version

    def _allocate(self, n: int) -> list[int] | None:
        got = self.allocator.allocate(n)
        if got is None and self.prefix is not None:
            self.prefix.evict(n - self.allocator.num_free)
            got = self.allocator.allocate(n)
        return got

    def free(self, req) -> None:
        seq = req.kv
        if seq is None:
            return
        if self.prefix is not None and (self._prefix_stale or seq.version == self.prefix_version):
            # Its full blocks stay findable by the tokens they hold (only KV of the weights being
            # served: a sequence that began under older weights keeps its KV to itself).
            self.prefix.insert(self.tokens_of(req), seq.blocks, int(self._cached[seq.row]))
        self.allocator.free(seq.blocks)
        self._free_rows.append(seq.row)
        req.kv = None

    def _flush_block_table(self, host: torch.Tensor | None = None) -> None:
        """Write the queued block-table entries on the device. A decode step passes its pinned
        staging buffer: a copy from pageable memory may wait for the steps queued before it,
        which would undo queueing a step while the one before it runs."""
        rows, cols, vals = self._bt_updates
        if not rows:
            return
        self._bt_updates = ([], [], [])
        n = len(rows)
        if host is None or 3 * n > host.numel():
            upd = torch.tensor([rows, cols, vals], dtype=torch.long).to(self.device)
        else:
            staged = _rows(host, 3, n)
            staged.numpy()[:] = (rows, cols, vals)
            upd = staged.to(self.device, non_blocking=True)
        self._bt[upd[0], upd[1]] = upd[2].to(torch.int32)

    def rows_of(self, running) -> np.ndarray:
        """The batch rows of ``running`` (to pass to ``ensure_slots`` and ``decode`` of one step)."""
        # Built per call: a step decodes the running batch less the requests that end with
        # the token still in flight, so the list is not always the one of the step before.
        return np.fromiter((r.kv.row for r in running), dtype=np.int64, count=len(running))

    # ----- admission and preemption -----------------------------------------------------
    def admission_check(self, running: list):
        """A ``fits(request)`` callable for one admission wave: it books the blocks each admitted prompt needs.

        A reserve of about 1% of the pool is kept for the running batch's next blocks
        (only while something runs: an empty pool always takes the first request).
        """
        # Blocks only the prefix cache holds are free for the taking (evicted on allocation); a
        # request is charged its whole length, which covers any cached blocks it will pin.
        # (Counted only when the free list falls short: a walk over the cache on every step would
        # cost the host more than the decode step.)
        free = self.allocator.num_free
        reserve = max(1, self.allocator.capacity // 100)
        seen: set = set()
        state = {"taken": bool(running), "counted": self.prefix is None}

        def fits(req) -> bool:
            nonlocal free
            n = len(req.prompt_ids) + len(req.token_ids)
            key = self.share_key(req)
            need = (1 if n % self.block_size else 0) if key in seen else blocks_for(n, self.block_size)
            if free - need < (reserve if state["taken"] else 0) and not state["counted"]:
                state["counted"] = True
                free += self.prefix.evictable()
            if free - need < (reserve if state["taken"] else 0):
                return False
            free -= need
            seen.add(key)
            state["taken"] = True
            return True

        return fits

    def ensure_slots(self, running: list, rows: np.ndarray | None = None) -> list:
        """Give each running request a slot for its next token; preempt from the end when the pool is full.
        ``rows``: ``rows_of(running)`` if the caller has it."""
        rows = self.rows_of(running) if rows is None else rows
        need = np.flatnonzero(self._cached[rows] % self.block_size == 0)
        end, preempted = len(running), []
        for i in need.tolist():
            if i >= end:
                break
            got = self._allocate(1)
            while got is None and end - 1 > i:
                end -= 1
                preempted.append(running[end])
                self.free(running[end])
                got = self._allocate(1)
            if got is None:
                if i == 0:
                    raise RuntimeError(f"the KV pool ({self.allocator.capacity} blocks of {self.block_size} tokens) "
                                       f"cannot hold one sequence of {self._cached[rows[0]] + 1} tokens; "
                                       f"raise kv_fraction / kv_blocks or lower max_new_tokens")
                end = i
                preempted.append(running[i])
                self.free(running[i])
                break
            self._append_block(running[i].kv, got[0])
        return preempted  # the tail of ``running``, last first

    # ----- prefill ------------------------------------------------------------------
    def prefill(self, requests: list) -> torch.Tensor:
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(self.share_key(r), []).append(i)
        leaders = [members[0] for members in groups.values()]
        for i in leaders:
            r = requests[i]
            n = len(r.prompt_ids) + len(r.token_ids)
            cached = [self.allocator.share(b) for b in self.prefix.lookup(self.tokens_of(r))] \
                if self.prefix is not None else []
            blocks = self._allocate(blocks_for(n, self.block_size) - len(cached))
            if blocks is None:
                raise RuntimeError("fast runner: prefill admitted more tokens than the KV pool holds")
            r.kv = self._new_seq(cached + blocks, n)
            r.kv.start, r.kv.version = len(cached) * self.block_size, self.prefix_version
        logits = self._prefill_leaders([requests[i] for i in leaders])
        row_of = {}
        for j, (key, members) in enumerate(groups.items()):
            row_of.update({m: j for m in members})
            self._share_prompt(requests[members[0]], [requests[m] for m in members[1:]])
        index = torch.tensor([row_of[i] for i in range(len(requests))], device=logits.device)
        return logits.index_select(0, index)

    def _share_prompt(self, leader, followers: list) -> None:
        """Followers reference the leader's full blocks and copy its partial last block."""
        if not followers:
            return
        seq = leader.kv
        full, partial = divmod(seq.cached, self.block_size)
        src, dst = [], []
        for r in followers:
            blocks = [self.allocator.share(b) for b in seq.blocks[:full]]
            if partial:
                got = self._allocate(1)
                if got is None:
                    raise RuntimeError("fast runner: prefill admitted more tokens than the KV pool holds")
                src.append(seq.blocks[-1])
                dst.append(got[0])
                blocks += got
            r.kv = self._new_seq(blocks, seq.cached)
            r.kv.version = seq.version
        if src:
            pool = self.kv.view(self.net.num_layers, 2, -1, self.block_size, self.net.nkv, self.net.head_dim)
            s = torch.tensor(src, device=self.device)
            pool[:, :, torch.tensor(dst, device=self.device)] = pool[:, :, s]

    def _prefill_leaders(self, leaders: list) -> torch.Tensor:
        """Logits of each leader's last token; sequences run in chunks of about ``prefill_token_budget`` tokens."""
        order = sorted(range(len(leaders)), key=lambda i: leaders[i].kv.cached - leaders[i].kv.start)
        chunks, cur, tokens = [], [], 0
        for i in order:
            n = leaders[i].kv.cached - leaders[i].kv.start
            if cur and tokens + n > self.prefill_token_budget:
                chunks.append(cur)
                cur, tokens = [], 0
            cur.append(i)
            tokens += n
        chunks.append(cur)
        self._flush_block_table()
        out = torch.empty(len(leaders), self.net.vocab, dtype=self.dtype, device=self.device)
        for chunk in chunks:
            logits = self._prefill_chunk([leaders[i] for i in chunk])
            out[torch.tensor(chunk, device=self.device)] = logits
        return out

    def _prefill_chunk(self, seqs: list) -> torch.Tensor:
        """One forward over the tokens of ``seqs`` that have no KV yet (positions ``start..cached``)."""
        ps, dev, net = self.block_size, self.device, self.net
        spans = [(r.kv.start, r.kv.cached) for r in seqs]

        def slots_of(r, positions: np.ndarray) -> np.ndarray:
            return np.asarray(r.kv.blocks, dtype=np.int64)[positions // ps] * ps + positions % ps

        ids = np.concatenate([np.asarray(self.tokens_of(r)[s:n], dtype=np.int64) for r, (s, n) in zip(seqs, spans)])
        pos = np.concatenate([np.arange(s, n, dtype=np.int64) for s, n in spans])
        slots = np.concatenate([slots_of(r, np.arange(s, n)) for r, (s, n) in zip(seqs, spans)])
        ids_t, pos_t, slots_t = (torch.from_numpy(a).to(dev) for a in (ids, pos, slots))
        if all(st == 0 for st, _ in spans) and len({n for _, n in spans}) <= 4:
            attend = self._attend_runs([n for _, n in spans], slots_t)
        else:
            attend = self._attend_padded(seqs, spans, slots_of)
        hidden = net.forward(ids_t, pos_t, slots_t, self._layer_kv, attend, self.ops)
        last = torch.from_numpy(np.cumsum([n - s for s, n in spans]) - 1).to(dev)
        return net.logits(hidden.index_select(0, last))

    def _attend_runs(self, lens: list[int], slots_t: torch.Tensor):
        """Attention of fresh sequences, one causal call per run of equal lengths (prompts of one
        length, as in a batch of same-size prompts, attend in a single call)."""
        net, dev = self.net, self.device
        runs, start = [], 0  # (first token, sequences, length) of each run of equal lengths
        for n in lens:
            if runs and runs[-1][2] == n and runs[-1][0] + runs[-1][1] * n == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, n)
            else:
                runs.append((start, 1, n))
            start += n

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            k, v = self.kv[i, 0][slots_t], self.kv[i, 1][slots_t]
            out = torch.empty(q.shape[0], net.nq * net.head_dim, dtype=q.dtype, device=dev)
            for first, count, n in runs:
                part = slice(first, first + count * n)
                qs = q[part].view(count, n, net.nq, -1).transpose(1, 2)
                ks = k[part].view(count, n, net.nkv, -1).transpose(1, 2)
                vs = v[part].view(count, n, net.nkv, -1).transpose(1, 2)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=net.scale, enable_gqa=True)
                out[part] = o.transpose(1, 2).reshape(count * n, -1)
            return out
        return attend

    def _attend_padded(self, seqs: list, spans: list[tuple[int, int]], slots_of):
        """Attention of sequences of any lengths, with or without a cached prefix, in ONE call per
        layer: queries (the new tokens) and keys (the whole context, read from the pool) padded
        to the longest, a mask for causality from the end of each context and for the padding.
        (One call per sequence costs a launch per sequence and layer: the host becomes the limit
        when every sequence has its own length, as a multi-turn episode's turns do.)"""
        net, dev = self.net, self.device
        B = len(seqs)
        qlen = np.array([n - st for st, n in spans])
        klen = np.array([n for _, n in spans])
        maxq, maxk = int(qlen.max()), int(klen.max())
        q_rows = torch.from_numpy(np.concatenate([b * maxq + np.arange(m) for b, m in enumerate(qlen)])).to(dev)
        ctx = np.zeros((B, maxk), dtype=np.int64)  # padding reads slot 0 (the null block), masked out
        for b, (r, (_, n)) in enumerate(zip(seqs, spans)):
            ctx[b, :n] = slots_of(r, np.arange(n))
        ctx_t = torch.from_numpy(ctx).to(dev)
        qpos = torch.from_numpy(klen - qlen).to(dev)[:, None] + torch.arange(maxq, device=dev)[None, :]  # [B, maxq]
        keys = torch.arange(maxk, device=dev)
        mask = (keys[None, None, :] <= qpos[:, :, None]) & (keys[None, None, :] < torch.from_numpy(klen).to(dev)[:, None, None])
        mask[:, :, 0] = True  # padded query rows attend to something (their output is dropped)
        mask = mask[:, None]  # [B, 1, maxq, maxk]
        rep = net.nq // net.nkv

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            qp = torch.zeros(B * maxq, net.nq, net.head_dim, dtype=q.dtype, device=dev)
            qp[q_rows] = q.view(-1, net.nq, net.head_dim)
            # Key / value heads repeated for the query heads: the kernels that take a mask need it.
            k = self.kv[i, 0][ctx_t].repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, nq, maxk, d]
            v = self.kv[i, 1][ctx_t].repeat_interleave(rep, dim=2).transpose(1, 2)
            o = F.scaled_dot_product_attention(qp.view(B, maxq, net.nq, -1).transpose(1, 2), k, v,
                                               attn_mask=mask, scale=net.scale)
            return o.transpose(1, 2).reshape(B * maxq, -1)[q_rows]
        return attend

    def _layer_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[i, 0], self.kv[i, 1]

    # ----- decode -------------------------------------------------------------------
    def _bucket(self, b: int) -> int:
        for size in self.buckets:
            if size >= b:
                return size
        return b

    def room_for_next_tokens(self, running: list) -> bool:
        """Whether every running request's next token fits the pool without preempting."""
        rows = self.rows_of(running)
        return int(np.count_nonzero(self._cached[rows] % self.block_size == 0)) <= self.allocator.num_free

    def decode(self, running: list, last: torch.Tensor | None = None, src: list[int] | None = None,
               rows: np.ndarray | None = None) -> torch.Tensor:
        """One token for every running request (call ``ensure_slots`` first). A request whose
        last token is still on the device (sampled by the step before, not read back yet)
        has its index into ``last`` in ``src`` (-1 for the others): the input is taken there.
        ``rows``: ``rows_of(running)`` if the caller has it."""
        b = len(running)
        rows = self.rows_of(running) if rows is None else rows
        pos = self._cached[rows]
        size = self._bucket(b)
        host, bt_host = _rows(self._hosts[self._turn], 6, size), self._bt_hosts[self._turn]
        self._turn ^= 1
        h = host.numpy()
        h[0, :b] = np.fromiter((r.token_ids[-1] for r in running), dtype=np.int64, count=b)
        h[1, :b] = pos
        h[2, :b] = self._tail[rows] * self.block_size + pos % self.block_size
        h[3, :b] = pos + 1
        h[4, :b] = rows
        h[5, :b] = -1 if src is None else src
        # Padded rows write to the null block and attend to one token of it.
        h[0:3, b:size] = 0
        h[3, b:size] = 1
        h[4, b:size] = self.null_row
        h[5, b:size] = -1
        self._flush_block_table(bt_host)
        inp = _rows(self._inp, 6, size)
        inp.copy_(host, non_blocking=True)
        if last is not None:
            ids, at = inp[0, :b], inp[5, :b]
            torch.where(at >= 0, last.index_select(0, at.clamp(min=0)), ids, out=ids)
        graph = self._graphs.get(size)
        if graph is not None:
            graph[0].replay()
            logits = graph[1][:b]
        else:
            logits = self._decode_forward(size, int(pos.max()) + 1)[:b]
        self._cached[rows] += 1
        return logits

    def _decode_forward(self, size: int, max_ctx: int) -> torch.Tensor:
        ids, pos, slots, ctx, rows = _rows(self._inp, 6, size)[:5]
        tables = self._bt.index_select(0, rows)
        net, ops = self.net, self.ops

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            return ops.decode_attention(q, self.kv[i, 0], self.kv[i, 1], tables, ctx, net.scale,
                                        self.block_size, max_ctx)

        return net.logits(net.forward(ids, pos, slots, self._layer_kv, attend, ops))

    def _capture_graphs(self) -> None:
        """Capture one decode graph per bucket, largest first, sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        # The capture runs on this engine's own stream of its own GPU: torch.cuda.graph's default
        # capture stream is made once per process, on the first GPU that captured, so a second
        # engine on another GPU (a judge beside the policy) would capture nothing there.
        stream = torch.cuda.Stream(device=self.device)
        with torch.no_grad():
            for size in sorted(self.buckets, reverse=True):
                host = _rows(self._hosts[0], 6, size)
                h = host.numpy()
                h[0:3], h[3], h[4], h[5] = 0, 1, self.null_row, -1
                _rows(self._inp, 6, size).copy_(host)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._decode_forward(size, 1)  # compiles the kernels outside the capture
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._decode_forward(size, 1)
                self._graphs[size] = (graph, out)
        torch.cuda.synchronize()


def _rows(flat: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The first ``k * n`` elements of ``flat`` as a contiguous ``[k, n]`` block."""
    return flat[:k * n].view(k, n)
