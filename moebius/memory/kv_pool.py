"""Paged KV cache: an allocator of page ids, and a pool that owns each layer's page bytes.

The allocator knows nothing about bytes; the pool knows nothing about requests. A page id names the same page in
every layer (page p of layer i lives in layer i's slot), as in vLLM.
"""

from __future__ import annotations

import torch

from moebius.memory.umm import UnifiedMemory


class OutOfPages(RuntimeError):
    pass


class BlockAllocator:
    """Free list of page ids 1..num_pages-1; page 0 is reserved as scratch (padding rows of a CUDA-graph batch
    read and write it), so it is never handed out. Allocation order is deterministic (lowest ids first)."""

    def __init__(self, num_pages: int, block_size: int) -> None:
        if num_pages <= 1:
            raise ValueError(f"the KV pool has no usable pages (num_pages={num_pages}, page 0 is reserved); "
                             "give it more memory")
        self.num_pages = num_pages
        self.block_size = block_size
        # pages given back (reused last-in first-out), then the never-used ids from _fresh up: no list of every
        # page, so a switch's fresh allocator costs nothing however large the pool
        self._free: list[int] = []
        self._fresh = 1
        self._used = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_pages - self._fresh

    @property
    def free_tokens(self) -> int:
        return self.num_free * self.block_size

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def total_tokens(self) -> int:
        return self.usable_pages * self.block_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} KV pages, {self.num_free} free")
        reused = min(n, len(self._free))
        pages = [self._free.pop() for _ in range(reused)] + list(range(self._fresh, self._fresh + n - reused))
        self._fresh += n - reused
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        # checked before anything changes, so a bad call leaves the allocator as it was
        if len(set(pages)) != len(pages) or not all(self._used[p] for p in pages):
            p = next(p for i, p in enumerate(pages) if not self._used[p] or p in pages[:i])
            raise RuntimeError(f"KV page {p} freed twice")
        for p in pages:
            self._used[p] = 0
        self._free.extend(reversed(pages))


class KVPool:
    """Per-layer KV views [num_pages, 2 (K, V), block_size, kv_heads, head_dim] inside the layer slots.

    A page is contiguous (K then V of its block_size tokens), so moving a page is one contiguous copy.
    """

    def __init__(self, umm: UnifiedMemory, slots: list[int], offset: int, num_pages: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        shape = (num_pages, 2, block_size, num_kv_heads, head_dim)
        self.layers = [umm.slot_view(s, offset, shape, dtype) for s in slots]
        self.num_pages = num_pages
        self.block_size = block_size

    @staticmethod
    def page_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
