"""Paged KV cache bookkeeping: a block allocator with reference counts, and pool sizing.

- The KV pool is ``num_blocks`` blocks of ``block_size`` token slots each; block 0 is the null
  block, never handed out (padded rows of a CUDA-graph batch point at it).
- ``BlockAllocator``: ``allocate(n)`` (all ``n`` or none), ``share(block)``, ``free(blocks)``,
  by reference count.
- ``kv_pool_blocks(...)`` turns a memory budget into a block count.

It knows nothing of models, requests or tensors' contents: only integers.
"""
from __future__ import annotations

import math

# CPU pools are for tests and laptops: 4096 token slots at the default block size.
CPU_DEFAULT_BLOCKS = 256


class BlockAllocator:
    """Free-list allocator of KV blocks with reference counts (block 0 is reserved).

    - The KV pool is ``num_blocks`` blocks of ``block_size`` token slots each. Block 0
      is the null block: it is never handed out, so padded rows of a CUDA-graph batch
      can point their block table and their write slot at it without touching any
      sequence's data.
    - ``BlockAllocator.allocate(n)`` returns ``n`` distinct free block ids (each with
      reference count 1) or ``None`` when fewer than ``n`` are free; it never hands out
      part of a request. ``share(block)`` adds a reference (the samples of one prompt
      share its full prompt blocks); ``free(blocks)`` drops one reference per id and
      returns a block to the free list when its count reaches 0. Freed blocks are
      reused first (a stack), which keeps the touched part of the pool small.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        # A stack: the lowest ids are handed out first and freed blocks are reused first.
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        return out

    def share(self, block: int) -> int:
        if self.refcount[block] <= 0:
            raise ValueError(f"share: block {block} is not allocated")
        self.refcount[block] += 1
        return block

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            count = self.refcount[b]
            if count <= 0:
                raise ValueError(f"free: block {b} is not allocated (double free)")
            self.refcount[b] = count - 1
            if count == 1:
                self._free.append(b)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` token slots."""
    return -(-tokens // block_size)


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for one token."""
    return 2 * num_layers * kv_heads * head_dim * dtype_bytes


def kv_pool_blocks(*, device_type: str, bytes_per_block: int, kv_fraction: float, kv_blocks: int | None,
                   workspace_bytes: int, free_bytes: int | None = None) -> int:
    """Number of blocks for the pool (``kv_blocks`` wins when given).

    On a GPU: ``kv_fraction`` of the free memory minus ``workspace_bytes`` (the
    logits and sampling temporaries of the largest decode batch, which must fit
    beside the pool or the first large step runs out of memory).

    ``kv_pool_blocks(...)`` turns a memory budget into a block count: on a GPU a
    fraction of the memory that is free once the model is loaded, minus a reserve
    for the logits and sampling workspace of the largest batch; on the CPU a fixed
    small pool.
    """
    if kv_blocks is not None:
        if kv_blocks < 2:
            raise ValueError(f"kv_blocks must be >= 2, got {kv_blocks}")
        return int(kv_blocks)
    if not 0.0 < kv_fraction <= 1.0:
        raise ValueError(f"kv_fraction must be in (0, 1], got {kv_fraction}")
    if device_type != "cuda":
        return CPU_DEFAULT_BLOCKS
    if free_bytes is None:
        import torch

        free_bytes = torch.cuda.mem_get_info()[0]
    budget = free_bytes * kv_fraction - workspace_bytes
    blocks = int(math.floor(budget / bytes_per_block))
    if blocks < 2:
        raise RuntimeError(f"no GPU memory left for the KV cache: {free_bytes / 2**30:.2f} GiB free, "
                           f"kv_fraction {kv_fraction}, workspace {workspace_bytes / 2**30:.2f} GiB; "
                           f"lower rollout.max_batch, raise rollout.kv_fraction, or give the "
                           "engine a GPU of its own (launch.placement=disaggregated)")
    return blocks
