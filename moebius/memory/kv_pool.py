"""Paged KV cache: an allocator of page ids (with the prefix cache's index of computed pages), and a pool
that owns each layer's page bytes.

The allocator knows nothing about bytes; the pool knows nothing about requests. A page id names the same page in
every layer (page p of layer i lives in layer i's slot), as in vLLM.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Iterable

import torch

from moebius.config import ConfigError, KVSpec
from moebius.memory.umm import UnifiedMemory

# KV tokens a CPU rank holds when --max-total-tokens is unset (no device memory to size the cache by)
CPU_DEFAULT_KV_TOKENS = 65536
# page 0 is reserved scratch (padding rows of a step read and write it): one more is the least that serves a request
MIN_PAGES = 2


def kv_budget(max_total_tokens: int | None, block_size: int, device: str) -> int | None:
    """KV pages a rank holds by the flags (None: sized from GPU memory on the rank); ConfigError naming the setting
    and the numbers unless they leave a page beside the reserved page 0."""
    least = MIN_PAGES * block_size
    if max_total_tokens is not None:
        tokens, setting = max_total_tokens, f"--max-total-tokens {max_total_tokens}"
        fix = f"set --max-total-tokens to at least {least} ({MIN_PAGES} pages) or lower --block-size"
    elif device != "cuda":
        tokens = CPU_DEFAULT_KV_TOKENS
        setting = f"the CPU's default KV budget of {tokens} tokens (--max-total-tokens unset)"
        fix = (f"lower --block-size to at most {tokens // MIN_PAGES}, or set --max-total-tokens to at least {least} "
               f"({MIN_PAGES} pages)")
    else:
        return None
    pages = tokens // block_size
    if pages < MIN_PAGES:
        raise ConfigError(f"{setting} with --block-size {block_size} makes {pages} KV page{'s' if pages != 1 else ''} "
                          f"of {block_size} tokens, and page 0 is reserved (scratch for padded rows): no page is left "
                          f"for requests; {fix}")
    return pages


class OutOfPages(RuntimeError):
    pass


class BlockAllocator:
    """Page ids 1..num_pages-1 with reference counts, and the prefix cache's index of computed full pages.

    Page 0 is reserved as scratch (padding rows of a CUDA-graph batch read and write it), so it is never handed
    out. Allocation order is deterministic (TP ranks keep identical allocators).

    Prefix cache: a full page of tokens that a step computes can be `register`ed under its key (the key of
    the page before it, and its tokens), and a later request whose prompt starts with the same tokens `match`es the
    chain and `share`s those pages instead of computing them (as vLLM's automatic prefix caching). A page is free
    when no request holds it; a free page that is in the index stays there, and is evicted (least recently freed
    first, a chain's last pages before its first) only when `allocate` has no never-cached page left. Keys are ids
    given out once, so an evicted page's key never names different tokens later.
    """

    def __init__(self, num_pages: int, block_size: int) -> None:
        if num_pages < MIN_PAGES:  # the engine sizes pools by kv_budget first: this is a caller's mistake
            raise ValueError(f"a KV allocator needs at least {MIN_PAGES} pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.block_size = block_size
        # pages given back (reused last-in first-out), then the never-used ids from _fresh up: no list of every
        # page, so a switch's fresh allocator costs nothing however large the pool
        self._free: list[int] = []
        self._fresh = 1
        self._refs = array("I", bytes(4 * num_pages))  # requests holding each page
        self._index: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}  # (parent key, tokens) -> (page, key)
        self._page_entry: dict[int, tuple[int, tuple[int, ...]]] = {}  # indexed page -> its index entry
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed pages no request holds
        self._keys = itertools.count(1)  # 0 is the root: the key "before" a prompt's first page

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_pages - self._fresh + len(self._evictable)

    @property
    def free_tokens(self) -> int:
        return self.num_free * self.block_size

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def total_tokens(self) -> int:
        return self.usable_pages * self.block_size

    @property
    def cached_pages(self) -> int:
        return len(self._page_entry)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} KV pages, {self.num_free} free")
        reused = min(n, len(self._free))
        pages = [self._free.pop() for _ in range(reused)]
        fresh = min(n - reused, self.num_pages - self._fresh)
        pages += range(self._fresh, self._fresh + fresh)
        self._fresh += fresh
        for _ in range(n - len(pages)):
            page, _ = self._evictable.popitem(last=False)
            del self._index[self._page_entry.pop(page)]
            pages.append(page)
        for p in pages:
            self._refs[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page (a request's whole table: no page twice)."""
        # checked before anything changes, so a bad call leaves the allocator as it was
        if len(set(pages)) != len(pages) or not all(self._refs[p] for p in pages):
            p = next(p for i, p in enumerate(pages) if not self._refs[p] or p in pages[:i])
            raise RuntimeError(f"KV page {p} freed twice")
        for p in reversed(pages):  # a chain's last pages first: they are evicted first
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._page_entry:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def share(self, pages: list[int]) -> None:
        """One more reference to each of these held or indexed pages (a request starting with their tokens)."""
        for p in pages:
            if self._refs[p] == 0:
                del self._evictable[p]
            self._refs[p] += 1

    def evictable(self, pages: list[int]) -> int:
        """How many of these pages are free (in the index, held by no request): sharing them takes them from
        `num_free`."""
        return sum(self._refs[p] == 0 for p in pages)

    def match(self, block_tokens: Iterable[tuple[int, ...]]) -> tuple[list[int], list[int]]:
        """The indexed pages (and their keys) of the longest chain of full pages these tokens begin with."""
        pages: list[int] = []
        keys: list[int] = []
        parent = 0
        for tokens in block_tokens:
            hit = self._index.get((parent, tokens))
            if hit is None:
                break
            pages.append(hit[0])
            keys.append(parent := hit[1])
        return pages, keys

    def clear_cache(self) -> int:
        """Empty the index (vLLM's reset_prefix_cache): its free pages become plain free pages, and the pages
        requests hold are freed as plain pages. Returns how many pages it held."""
        n = len(self._page_entry)
        self._free += reversed(self._evictable)  # the least recently freed first, as they would have been evicted
        self._evictable.clear()
        self._index.clear()
        self._page_entry.clear()
        return n

    def register(self, page: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Index a computed full page (held by a request) under (the key before it, its tokens); returns its key.
        When those tokens are indexed already (another page computed them too), that key is returned and this
        page stays out of the index (it is freed as any other)."""
        entry = (parent, tokens)
        hit = self._index.get(entry)
        if hit is not None:
            return hit[1]
        if not self._refs[page] or page in self._page_entry:
            raise RuntimeError(f"KV page {page} is not a held page outside the index")
        key = next(self._keys)
        self._index[entry] = (page, key)
        self._page_entry[page] = entry
        return key


class KVPool:
    """Per-layer cache views [num_pages, parts, block_size, heads, dim] inside the layer slots, as the family's KV
    spec says (K and V heads: [pages, 2, bs, kv_heads, head_dim]; an MLA latent: [pages, 1, bs, 1, latent]), with
    `heads` the heads this rank holds.

    A page is contiguous (every part of its block_size tokens), so moving a page is one contiguous copy.
    """

    def __init__(self, umm: UnifiedMemory, slots: list[int], offset: int, num_pages: int, block_size: int,
                 spec: KVSpec, heads: int, dtype: torch.dtype) -> None:
        shape = (num_pages, spec.parts, block_size, heads, spec.dim)
        self.layers = [umm.slot_view(s, offset, shape, dtype) for s in slots]
        self.num_pages = num_pages
        self.block_size = block_size

    @staticmethod
    def page_bytes(block_size: int, spec: KVSpec, heads: int, dtype: torch.dtype) -> int:
        return spec.parts * block_size * heads * spec.dim * dtype.itemsize
