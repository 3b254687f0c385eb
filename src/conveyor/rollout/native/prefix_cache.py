"""Prefix cache of the paged runner: full KV blocks of ended sequences, found again by their tokens.

Contract: ``PrefixCache(allocator, block_size)`` keeps full blocks keyed by a digest of all
tokens up to each block's end; ``lookup(tokens)`` returns the blocks of the longest cached
prefix, always leaving one token to compute; ``evict(n)`` frees least recently used blocks
first. KV is valid only for the weights that computed it, so the engine clears the cache on
every weight update.

This is what keeps a multi-turn episode's KV between turns: a turn's
request (the history plus the observation) finds the blocks the previous
turn left. It knows nothing of models, devices or requests.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from conveyor.rollout.native.paged import BlockAllocator


class PrefixCache:
    """Contract: ``PrefixCache(allocator, block_size)``. ``insert(tokens, blocks,
    written)`` keeps (one reference to) each full block of a sequence whose KV
    holds its first ``written`` tokens, keyed by a digest of all tokens up to
    the block's end (a chain: block i's key covers blocks 0..i); ``lookup(tokens)``
    returns the blocks of the longest cached prefix of whole blocks, leaving at
    least one token to compute (the caller needs its logits), and marks them
    recently used; ``peek`` counts them without touching. ``evictable()``
    counts blocks only the cache holds; ``evict(n)`` frees up to n of those,
    least recently used first. ``clear()`` drops every entry: KV is valid only
    for the weights that computed it, so the engine clears the cache on every
    weight update.
    """
    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator, self.block_size = allocator, block_size
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # chain digest -> block, LRU first
        self.hits = self.lookups = 0  # tokens found / tokens looked up (counters for the engine)

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, tokens: list[int], n_blocks: int):
        """The chain digests of the first ``n_blocks`` whole blocks of ``tokens``."""
        digest, bs = b"", self.block_size
        for i in range(n_blocks):
            digest = hashlib.blake2b(digest + array("q", tokens[i * bs:(i + 1) * bs]).tobytes(),
                                     digest_size=16).digest()
            yield digest

    def insert(self, tokens: list[int], blocks: list[int], written: int) -> None:
        n = min(written, len(tokens)) // self.block_size
        # Deepest block first, so the shallow ones (the shared prompt) are the most recently used:
        # eviction takes a chain from its end, and what stays is still reachable from its start.
        for key, block in reversed(list(zip(self._keys(tokens, n), blocks[:n]))):
            if key in self._blocks:
                self._blocks.move_to_end(key)
            else:
                self._blocks[key] = self.allocator.share(block)

    def _match(self, tokens: list[int], touch: bool) -> list[int]:
        usable = (len(tokens) - 1) // self.block_size  # at least one token is left to compute
        found, keys = [], []
        for key in self._keys(tokens, usable):
            block = self._blocks.get(key)
            if block is None:
                break
            keys.append(key)
            found.append(block)
        if touch:
            for key in reversed(keys):
                self._blocks.move_to_end(key)
        return found

    def lookup(self, tokens: list[int]) -> list[int]:
        found = self._match(tokens, touch=True)
        self.lookups += len(tokens)
        self.hits += len(found) * self.block_size
        return found

    def peek(self, tokens: list[int]) -> int:
        return len(self._match(tokens, touch=False))

    def evictable(self) -> int:
        rc = self.allocator.refcount
        return sum(1 for b in self._blocks.values() if rc[b] == 1)

    def evict(self, n: int) -> int:
        """Free up to ``n`` blocks no sequence uses, least recently used first; how many were freed."""
        rc, freed = self.allocator.refcount, 0
        for key in list(self._blocks):
            if freed >= n:
                break
            block = self._blocks[key]
            if rc[block] == 1:
                del self._blocks[key]
                self.allocator.free([block])
                freed += 1
        return freed

    def clear(self) -> None:
        blocks, self._blocks = list(self._blocks.values()), OrderedDict()
        self.allocator.free(blocks)
