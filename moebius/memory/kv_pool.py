"""Paged KV cache: an allocator of page ids (with the prefix cache's index of computed pages), and a pool
that owns each layer's page bytes.

The allocator knows nothing about bytes; the pool knows nothing about requests. A page id names the same page in
every layer (page p of layer i lives in layer i's slot), as in vLLM.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from moebius.config import ConfigError, KVSpec, first_live_page
from moebius.memory.umm import UnifiedMemory

# KV tokens a CPU rank holds when --max-total-tokens is unset (no device memory to size the cache by)
CPU_DEFAULT_KV_TOKENS = 65536
# page 0 is reserved scratch (padding rows of a step read and write it): one more is the least that serves a request
MIN_PAGES = 2


def window_pages(window: int, block_size: int, max_running: int, max_batched_tokens: int) -> int:
    """The pages a window group's allocator holds on a rank, page 0 included: the most its running requests can
    take (a request's chunk of n tokens from position p holds the pages from its first query's window, keys from
    p - window + 1, to its last token: ceil((window - 1 + n) / block_size) + 1 at most, `KVPages.grow` freeing a
    window's earlier pages before it gives any; at most `max_running` requests and `max_batched_tokens` tokens a
    step), and as many cached prefixes' windows (the pages a prefix's next query reads) as running requests, so
    that the prefix cache keeps prefixes under load as the first group does."""
    span = -(-(window - 1) // block_size)
    return max_running * (span + 2) + -(-max_batched_tokens // block_size) + max_running * (span + 1) + 1


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

    def lookup(self, parent: int, tokens: tuple[int, ...]) -> int | None:
        """The indexed page of these tokens after the page keyed `parent` (None: not indexed)."""
        hit = self._index.get((parent, tokens))
        return None if hit is None else hit[0]

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


class KVPages:
    """A rank's page allocators, one a KV group (`ModelConfig.kv_groups`; one in most models), and a request's page
    tables in them (`Request.tables`, one a group). A table covers its request's tokens from the first; a
    sliding-window group's table names page 0 before its window, those pages freed as the window moves on (`trim`),
    so that the group holds a window's pages a request however long it grows. The first group's allocator holds the
    prefix cache's chain of keys; another group indexes its pages under the first group's keys (vLLM's hybrid
    prefix caching: a prefix is cached where the first group holds its pages and each window group the pages of
    the window its next query reads, those freed as the window moved on included, until evicted). A window group
    after a full one has only the pages its running requests' windows can take and as many cached windows
    (`window_pages`; its layers' slots hold no more, worker/build.py), so the first group bounds how many tokens a
    rank holds."""

    def __init__(self, num_pages: int | Sequence[int], block_size: int, windows: Sequence[int | None] = (None,)
                 ) -> None:
        """num_pages: each group's, or one count for every group."""
        counts = [num_pages] * len(windows) if isinstance(num_pages, int) else list(num_pages)
        if len(counts) != len(windows):
            raise ValueError(f"{len(counts)} page counts for {len(windows)} KV groups")
        self.groups = [BlockAllocator(n, block_size) for n in counts]
        self.windows = tuple(windows)
        self.block_size = block_size
        self.windowed = any(w is not None for w in windows)

    def empty(self) -> list[list[int]]:
        """A request's tables before it holds a page: one empty table a group."""
        return [[] for _ in self.groups]

    @property
    def first(self) -> BlockAllocator:
        """The first group's allocator: the prefix cache's, and the one the rank's KV statistics report."""
        return self.groups[0]

    def need(self, tables: Sequence[Sequence[int]], start: int, stop: int) -> list[int]:
        """The pages each group gives a request whose tables are `tables` so that its tokens up to `stop` have pages,
        its next chunk starting at `start` (a window group's pages before that chunk's window are not given)."""
        n = self.first.pages_for(stop)
        return [max(0, n - max(len(t), first_live_page(start, w, self.block_size)))
                for t, w in zip(tables, self.windows, strict=True)]

    def grow(self, tables: Sequence[list[int]], start: int, stop: int) -> bool:
        """Pages for a running request's tokens up to `stop`, its next chunk from `start` (a window group's pages
        before that chunk's window freed first); False, nothing given, where some group has too few free. Once a
        step for each running request: without windows, integer arithmetic unless a page is due."""
        if not self.windowed:  # (then one group: groups are the layers by window)
            (table,) = tables
            if len(table) * self.block_size >= stop:  # (most decode steps: the last page has room)
                return True
            need = [-(-stop // self.block_size) - len(table)]
        else:
            self.trim(tables, start)
            if all(len(t) * self.block_size >= stop for t in tables):
                return True
            need = self.need(tables, start, stop)
        if not self.fits(need):
            return False
        self.extend(tables, start, need)
        return True

    def fits(self, need: Sequence[int], cached: Sequence[Sequence[int]] = ()) -> bool:
        """Whether every group has `need` pages free besides the free ones sharing the `cached` tables takes."""
        taken = [a.evictable([p for p in t if p]) for t, a in zip(cached, self.groups, strict=False)]
        return all(k + (taken[g] if g < len(taken) else 0) <= a.num_free
                   for g, (k, a) in enumerate(zip(need, self.groups, strict=True)))

    def match(self, tokens_of: Callable[[int], tuple[int, ...]], num_blocks: int
              ) -> tuple[list[list[int]], list[int]]:
        """The cached tables (a group each) and the first group's keys of the longest chain of full pages, among the
        first `num_blocks` of a request (page b's tokens: `tokens_of(b)`), such that every group holds what a query
        after it reads."""
        pages, keys = self.first.match(tokens_of(b) for b in range(num_blocks))
        bs = self.block_size
        for n in range(len(pages), -1, -1):
            tables: list[list[int]] = [pages[:n]]
            for a, w in zip(self.groups[1:], self.windows[1:], strict=True):
                lead = first_live_page(n * bs, w, bs)
                got: list[int] = []
                for b in range(lead, n):
                    page = a.lookup(keys[b - 1] if b else 0, tokens_of(b))
                    if page is None:
                        break
                    got.append(page)
                if len(got) < n - lead:
                    break
                tables.append([0] * lead + got)
            else:
                return tables, keys[:n]
        return self.empty(), []

    def share(self, tables: Sequence[Sequence[int]]) -> None:
        """One more reference to each page of these cached tables (page 0: none)."""
        for t, a in zip(tables, self.groups, strict=True):
            a.share([p for p in t if p])

    def register(self, tables: Sequence[Sequence[int]], b: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Index page b of a request's tables, its tokens computed and `parent` the first group's key of page b - 1
        (0 for the first); returns the first group's key of page b. A window group's page freed already is not
        indexed."""
        key = self.first.register(tables[0][b], parent, tokens)
        for t, a in zip(tables[1:], self.groups[1:], strict=True):
            if t[b]:
                a.register(t[b], parent, tokens)
        return key

    def clear_cache(self) -> int:
        """Empty every group's index (`BlockAllocator.clear_cache`); returns how many pages the first group's held."""
        return [a.clear_cache() for a in self.groups][0]

    def extend(self, tables: Sequence[list[int]], start: int, need: Sequence[int]) -> None:
        """Give the tables the pages `need` counted (page 0 before a window group's window)."""
        for t, w, k, a in zip(tables, self.windows, need, self.groups, strict=True):
            t += [0] * (first_live_page(start, w, self.block_size) - len(t))
            t += a.allocate(k)

    def trim(self, tables: Sequence[list[int]], start: int) -> None:
        """Free the window groups' pages no query from `start` on reads (page 0 in their place)."""
        for t, w, a in zip(tables, self.windows, self.groups, strict=True):
            if w is None:
                continue
            end = k = min(first_live_page(start, w, self.block_size), len(t))
            if not (k and t[k - 1]):  # nothing newly out of the window (most steps)
                continue
            while k and t[k - 1]:  # the pages freed before are page 0, a run from the first
                k -= 1
            a.free(t[k:end])
            t[k:end] = [0] * (end - k)

    def take(self, start: int, stop: int) -> list[list[int]]:
        """The tables of a request (the probes') whose tokens up to `stop` have pages, its next chunk starting at
        `start` (a window group's pages before that chunk's window: page 0)."""
        tables = self.empty()
        self.extend(tables, start, self.need(tables, start, stop))
        return tables

    def free(self, tables: Sequence[Sequence[int]]) -> None:
        """Drop a request's tables (page 0: freed already, or never its own; a request never admitted has none)."""
        for t, a in zip(tables, self.groups, strict=False):
            a.free([p for p in t if p])


class KVPool:
    """Per-layer cache views [pages, parts, block_size, heads, dim] inside the layer slots, as the family's KV
    spec says (K and V heads: [pages, 2, bs, kv_heads, head_dim]; an MLA latent: [pages, 1, bs, 1, latent]), with
    `heads` the heads this rank holds and `group_pages[g]` pages in a layer of KV group g (`layer_groups`).

    A page is contiguous (every part of its block_size tokens), so moving a page is one contiguous copy.
    """

    def __init__(self, umm: UnifiedMemory, slots: list[int], offsets: Sequence[int], group_pages: Sequence[int],
                 layer_groups: Sequence[int], block_size: int, spec: KVSpec, heads: int, dtype: torch.dtype) -> None:
        """slots, offsets, layer_groups: each layer's slot, the bytes into it where its pages start (after the slot's
        experts, if it holds any) and its KV group."""
        self.layers = [umm.slot_view(s, o, (group_pages[g], spec.parts, block_size, heads, spec.dim), dtype)
                       for s, o, g in zip(slots, offsets, layer_groups, strict=True)]
        self.group_pages = tuple(group_pages)
        self.block_size = block_size

    @property
    def num_pages(self) -> int:
        """The first KV group's pages (every layer's but a window group's: those hold fewer)."""
        return self.group_pages[0]

    @staticmethod
    def page_bytes(block_size: int, spec: KVSpec, heads: int, dtype: torch.dtype) -> int:
        return spec.parts * block_size * heads * spec.dim * dtype.itemsize
