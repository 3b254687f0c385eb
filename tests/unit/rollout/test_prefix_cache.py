"""The paged runner's prefix cache: a request that continues an ended sequence reuses its full KV
blocks and computes only the rest, with the same tokens and logprobs as a runner that computes
everything; blocks are reference-counted, evicted least recently used, and dropped when the
weights version changes."""
from __future__ import annotations

import copy

import pytest
import torch

from conveyor.data.tiny import build_model, build_tokenizer
from conveyor.rollout.api import SamplingParams
from conveyor.rollout.native import NativeEngine
from conveyor.rollout.native.paged import BlockAllocator
from conveyor.rollout.native.prefix_cache import PrefixCache


def test_insert_lookup_evict_clear_keep_reference_counts():
    alloc = BlockAllocator(16)
    cache = PrefixCache(alloc, block_size=4)
    blocks = alloc.allocate(3)
    tokens = list(range(10))  # two full blocks and a partial one
    cache.insert(tokens, blocks, written=10)
    assert len(cache) == 2 and [alloc.refcount[b] for b in blocks] == [2, 2, 1]
    assert cache.lookup(tokens + [99]) == blocks[:2]
    assert cache.lookup(list(range(8))) == blocks[:1]  # one token must be left to compute
    assert cache.lookup([0, 1, 2, 5, 4, 5, 6, 7, 8]) == []  # a different first block: nothing
    assert cache.evictable() == 0  # the sequence still holds them
    alloc.free(blocks)
    assert cache.evictable() == 2
    assert cache.evict(1) == 1 and len(cache) == 1
    assert cache.lookup(tokens) == blocks[:1]  # the deepest block went first: the start still matches
    cache.clear()
    assert len(cache) == 0 and alloc.num_free == alloc.capacity


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_model(tok, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                       seed=1).eval()


def engine(model, tok, prefix: bool):
    return NativeEngine(copy.deepcopy(model), tok, device="cpu", dtype="float32", runner="fast", kv_blocks=128,
                        block_size=4, max_batch=8, cuda_graphs=False, prefix_cache="version" if prefix else "off")


def test_continuing_a_sequence_reuses_its_blocks_with_the_same_result(model, tok):
    cached, plain = engine(model, tok, True), engine(model, tok, False)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = [tok.encode("turn one: abc"), tok.encode("another prompt, longer")]
    first = cached.generate(prompts, greedy)
    assert [c[0].token_ids for c in first] == [c[0].token_ids for c in plain.generate(prompts, greedy)]
    # The next turn: the history, then an observation, as a multi-turn episode sends it.
    nxt = [p + c[0].token_ids + tok.encode(" [obs] ") for p, c in zip(prompts, first)]
    runner = cached.runner
    hits0 = runner.prefix.hits
    a = cached.generate(nxt, SamplingParams(temperature=1.0, max_new_tokens=10, seed=5))
    b = plain.generate(nxt, SamplingParams(temperature=1.0, max_new_tokens=10, seed=5))
    reused = runner.prefix.hits - hits0
    assert reused >= 4 * 6  # most of each history came from the cache
    for x, y in zip(a, b):
        assert x[0].token_ids == y[0].token_ids
        # float32 both ways; attention over cached KV vs recomputed KV differs by rounding only
        assert torch.allclose(torch.tensor(x[0].logprobs), torch.tensor(y[0].logprobs), atol=1e-4)


def test_a_new_weights_version_drops_the_cache(model, tok):
    eng = engine(model, tok, True)
    p = [tok.encode("weights matter here")]
    out = eng.generate(p, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert len(eng.runner.prefix) > 0
    eng.update_weights({k: v.clone() for k, v in model.state_dict().items()}, version=1)
    hits0 = eng.runner.prefix.hits
    eng.generate([p[0] + out[0][0].token_ids], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert eng.runner.prefix.hits == hits0  # nothing reused across versions


def test_a_full_pool_evicts_cached_blocks_instead_of_failing(model, tok):
    eng = NativeEngine(copy.deepcopy(model), tok, device="cpu", dtype="float32", runner="fast", kv_blocks=24,
                       block_size=4, max_batch=4, cuda_graphs=False, prefix_cache="version")
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=0)
    for i in range(6):  # each call leaves blocks in the cache; the pool holds about one call
        out = eng.generate([tok.encode(f"prompt number {i} " * 2)] * 2, params)
        assert all(len(c[0].token_ids) >= 1 for c in out)
    assert eng.runner.allocator.num_free + eng.runner.prefix.evictable() == eng.runner.allocator.capacity


def test_stale_mode_keeps_the_cache_across_weight_swaps(model, tok):
    eng = NativeEngine(copy.deepcopy(model), tok, device="cpu", dtype="float32", runner="fast", kv_blocks=128,
                       block_size=4, max_batch=8, cuda_graphs=False, prefix_cache="stale")
    p = [tok.encode("weights matter here")]
    out = eng.generate(p, SamplingParams(temperature=0.0, max_new_tokens=8))
    eng.update_weights({k: v.clone() for k, v in model.state_dict().items()}, version=1)
    hits0 = eng.runner.prefix.hits
    eng.generate([p[0] + out[0][0].token_ids], SamplingParams(temperature=0.0, max_new_tokens=4))
    assert eng.runner.prefix.hits > hits0
