"""Paged KV cache: one preallocated pool of fixed-size blocks, block tables per sequence, prefix reuse.

Layout: `k_pool`/`v_pool` are `[layers, num_blocks * block_size, kv_heads, head_dim]`; a token's KV lives
at flat slot `block * block_size + offset`. Block 0 is reserved as the padding target of batched gathers.

Prefix reuse: a *full* block is identified by the hash of all tokens from the sequence start to the
block end (a hash chain), so two sequences share a block only when their whole prefix matches.
Finished sequences leave their full blocks in the cache (refcount 0, LRU); allocation evicts the least
recently used of those before failing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from gyre_cell.errors import KVCacheFullError


@dataclass(slots=True)
class SeqBlocks:
    """The blocks of one sequence and how many of its tokens have KV written."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    num_cached: int = 0
    """Tokens whose KV came from the prefix cache (reported as cached_tokens)."""
    slots: list[int] = field(default_factory=list)
    """Flat pool slot of every written token, in order (kept incrementally: read every step)."""


def _chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class PagedKVCache:
    """Block allocator + KV pool. Not thread-safe: the engine loop is its only user."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        max_total_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.block_size = block_size
        self.num_blocks = max(2, max_total_tokens // block_size + 1)  # +1: reserved padding block 0
        self.dtype, self.device = dtype, device
        self.k_pool: torch.Tensor | None = None
        self.v_pool: torch.Tensor | None = None
        self._refcount = [0] * self.num_blocks
        self._free: list[int] = []
        self._block_hash: dict[int, int] = {}  # block -> chain hash (full, registered blocks only)
        self._by_hash: dict[int, int] = {}  # chain hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached blocks, LRU first
        self.allocate()

    # ---- memory -------------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self.k_pool is not None

    def nbytes(self) -> int:
        if self.k_pool is None or self.v_pool is None:
            return 0
        return self.k_pool.nbytes + self.v_pool.nbytes

    def allocate(self) -> None:
        """(Re)create the pool; every block starts free and the prefix cache empty."""
        shape = (self.num_layers, self.num_blocks * self.block_size, self.kv_heads, self.head_dim)
        self.k_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._reset_tables()

    def release(self) -> None:
        """Drop the pool tensors (the memory goes back to the allocator/OS)."""
        self.k_pool = None
        self.v_pool = None
        self._reset_tables()

    def _reset_tables(self) -> None:
        self._refcount = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._block_hash.clear()
        self._by_hash.clear()
        self._evictable.clear()

    def flush(self) -> None:
        """Forget every cached prefix (blocks held by live sequences stay)."""
        for b in list(self._evictable):
            self._unregister(b)
            self._free.append(b)
        self._evictable.clear()
        for b in list(self._block_hash):
            self._unregister(b)

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def used_tokens(self) -> int:
        """Tokens in blocks held by live sequences (cached-but-unused blocks count as free)."""
        return sum(1 for r in self._refcount[1:] if r > 0) * self.block_size

    def available_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    # ---- allocation ---------------------------------------------------------------------------
    def _unregister(self, block: int) -> None:
        h = self._block_hash.pop(block, None)
        if h is not None and self._by_hash.get(h) == block:
            del self._by_hash[h]

    def _take_block(self) -> int:
        if self._free:
            b = self._free.pop()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._unregister(b)
        else:
            raise KVCacheFullError("KV cache is full")
        self._refcount[b] = 1
        return b

    def _incref(self, block: int) -> None:
        if self._refcount[block] == 0:
            self._evictable.pop(block, None)
        self._refcount[block] += 1

    def match_prefix(self, tokens: list[int], *, max_tokens: int) -> list[int]:
        """Cached blocks covering the longest whole-block prefix of `tokens[:max_tokens]`."""
        bs, parent, out = self.block_size, 0, []
        for start in range(0, max_tokens - bs + 1, bs):
            h = _chain_hash(parent, tuple(tokens[start : start + bs]))
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
            parent = h
        return out

    def new_sequence(self, tokens: list[int], *, reuse_prefix: bool) -> SeqBlocks:
        """Blocks for a sequence about to prefill `tokens`; reuses cached prefix blocks when allowed.
        At least one token is always left to compute (its logits start generation)."""
        seq = SeqBlocks()
        if reuse_prefix:
            for b in self.match_prefix(tokens, max_tokens=len(tokens) - 1):
                self._incref(b)
                seq.blocks.append(b)
            seq.num_tokens = seq.num_cached = len(seq.blocks) * self.block_size
            bs = self.block_size
            seq.slots = [b * bs + i for b in seq.blocks for i in range(bs)]
        return seq

    def blocks_needed(self, seq: SeqBlocks, new_tokens: int) -> int:
        total = seq.num_tokens + new_tokens
        return max(0, -(-total // self.block_size) - len(seq.blocks))

    def reserve(self, seq: SeqBlocks, new_tokens: int) -> list[int]:
        """Make room for `new_tokens` more tokens; returns their flat slot indices."""
        need = self.blocks_needed(seq, new_tokens)
        if need > self.available_blocks():
            raise KVCacheFullError(f"KV cache is full: need {need} blocks, {self.available_blocks()} left")
        for _ in range(need):
            seq.blocks.append(self._take_block())
        bs = self.block_size
        slots = [
            seq.blocks[p // bs] * bs + p % bs for p in range(seq.num_tokens, seq.num_tokens + new_tokens)
        ]
        seq.num_tokens += new_tokens
        seq.slots.extend(slots)
        return slots

    def slots_of(self, seq: SeqBlocks) -> list[int]:
        """Slots of every written token (the list is owned by `seq`; do not mutate)."""
        return seq.slots

    # ---- pinning and adoption (KV-cache migration) -----------------------------------------------
    def pin_blocks(self, blocks: list[int]) -> None:
        """Hold one more reference on each block: it is neither evicted nor handed out until unpinned. Every writer
        appends to blocks it took itself, so a pinned block's contents no longer change."""
        for b in blocks:
            self._incref(b)

    def unpin_blocks(self, blocks: list[int]) -> None:
        """Drop a reference taken by `pin_blocks` / `take_blocks`; cached full blocks stay reusable (LRU)."""
        for b in blocks:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if b in self._block_hash:
                    self._evictable[b] = None
                    self._evictable.move_to_end(b)
                else:
                    self._free.append(b)

    def take_blocks(self, n: int) -> list[int]:
        """`n` blocks owned by the caller (refcount 1, unregistered), e.g. to receive migrated KV."""
        if n > self.available_blocks():
            raise KVCacheFullError(f"KV cache is full: need {n} blocks, {self.available_blocks()} left")
        return [self._take_block() for _ in range(n)]

    def adopt_sequence(self, blocks: list[int], num_tokens: int) -> SeqBlocks:
        """A sequence over blocks the caller owns whose first `num_tokens` tokens already hold KV (the references
        move to the sequence; `free_sequence` releases them)."""
        bs = self.block_size
        seq = SeqBlocks(blocks=list(blocks), num_tokens=num_tokens, num_cached=num_tokens)
        seq.slots = [blocks[p // bs] * bs + p % bs for p in range(num_tokens)]
        return seq

    def block_refcount(self, block: int) -> int:
        return self._refcount[block]

    def free_sequence(self, seq: SeqBlocks, tokens: list[int] | None) -> None:
        """Release a sequence's blocks. With `tokens` (its written tokens) full blocks stay cached."""
        bs, parent = self.block_size, 0
        for i, b in enumerate(seq.blocks):
            full = tokens is not None and (i + 1) * bs <= min(len(tokens), seq.num_tokens)
            if full:
                h = _chain_hash(parent, tuple(tokens[i * bs : (i + 1) * bs]))
                parent = h
                if b not in self._block_hash and h not in self._by_hash:
                    self._block_hash[b] = h
                    self._by_hash[h] = b
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if b in self._block_hash:
                    self._evictable[b] = None
                    self._evictable.move_to_end(b)
                else:
                    self._free.append(b)
        seq.blocks.clear()
        seq.slots = []
        seq.num_tokens = seq.num_cached = 0
