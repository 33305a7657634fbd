import pytest
import torch

from gyre_cell.engine.kv_cache import PagedKVCache
from gyre_cell.errors import KVCacheFullError


def _cache(tokens=64, bs=4):
    return PagedKVCache(
        num_layers=1,
        kv_heads=1,
        head_dim=2,
        block_size=bs,
        max_total_tokens=tokens,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_reserve_slots_and_free():
    kv = _cache()
    seq = kv.new_sequence([1, 2, 3, 4, 5], reuse_prefix=True)
    assert seq.num_tokens == 0
    slots = kv.reserve(seq, 5)
    assert len(seq.blocks) == 2 and 0 not in seq.blocks  # block 0 is the padding block
    assert slots == [seq.blocks[0] * 4 + i for i in range(4)] + [seq.blocks[1] * 4]
    assert kv.used_tokens() == 8
    kv.free_sequence(seq, None)
    assert kv.used_tokens() == 0 and kv.available_blocks() == kv.num_blocks - 1


def test_prefix_reuse_whole_blocks_only_and_leaves_one_token():
    kv = _cache()
    a = kv.new_sequence(list(range(10)), reuse_prefix=True)
    kv.reserve(a, 10)
    a_blocks = list(a.blocks)
    kv.free_sequence(a, list(range(10)))  # two full blocks cached, the partial third freed
    b = kv.new_sequence([*range(9), 99, 100], reuse_prefix=True)
    assert b.num_cached == 8 and b.blocks == a_blocks[:2]
    c = kv.new_sequence(list(range(8)), reuse_prefix=True)
    assert c.num_cached == 4  # at least one token must still be computed
    d = kv.new_sequence([0, 1, 2, 7, 4, 5, 6, 7], reuse_prefix=True)
    assert d.num_cached == 0  # first block differs


def test_lru_eviction_then_full():
    kv = _cache(tokens=16)  # 4 usable blocks
    a = kv.new_sequence(list(range(8)), reuse_prefix=True)
    kv.reserve(a, 8)
    kv.free_sequence(a, list(range(8)))
    assert kv.available_blocks() == 4
    b = kv.new_sequence([50] * 16, reuse_prefix=True)
    kv.reserve(b, 16)  # evicts the cached blocks
    assert kv.match_prefix(list(range(8)), max_tokens=8) == []
    with pytest.raises(KVCacheFullError):
        kv.reserve(b, 1)


def test_release_frees_pool_and_flush_forgets_prefixes():
    kv = _cache()
    a = kv.new_sequence(list(range(8)), reuse_prefix=True)
    kv.reserve(a, 8)
    kv.free_sequence(a, list(range(8)))
    kv.flush()
    assert kv.match_prefix(list(range(8)), max_tokens=8) == []
    assert kv.nbytes() > 0
    kv.release()
    assert kv.nbytes() == 0 and not kv.allocated
    kv.allocate()
    assert kv.nbytes() > 0


def test_slots_track_every_written_token_including_reused_prefix():
    kv = _cache()
    a = kv.new_sequence(list(range(9)), reuse_prefix=True)
    kv.reserve(a, 9)
    kv.reserve(a, 1)
    bs = kv.block_size
    assert kv.slots_of(a) == [a.blocks[p // bs] * bs + p % bs for p in range(10)]
    kv.free_sequence(a, list(range(10)))
    b = kv.new_sequence(list(range(10)), reuse_prefix=True)
    kv.reserve(b, 2)
    assert len(kv.slots_of(b)) == b.num_tokens == 10
    assert kv.slots_of(b) == [b.blocks[p // bs] * bs + p % bs for p in range(10)]
