"""Page table of the paged KV cache: 256-token pages, reference counts, chained prefix hashes, LRU reuse.

The cache is one flat row of `num_pages * page_size` tokens (256 per page, as exllamav2; smaller pages are an
exlpy extension that tests use); page p owns rows [p*size, (p+1)*size). A full page of
tokens is identified by a chained hash `blake2b(prev_hash || int64 token bytes, 16 bytes)`, so equal hashes
mean equal token prefixes and therefore equal K/V. Pages whose reference count drops to zero keep their hash
and contents until the least-recently-used policy hands them to a new job: a later prompt with the same prefix
references them again instead of recomputing.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

PAGE_SIZE = 256


def page_hash(prev: bytes | None, tokens: torch.Tensor) -> bytes:
    """Chained hash of one full page of token ids."""
    h = hashlib.blake2b(digest_size=16)
    if prev is not None:
        h.update(prev)
    h.update(tokens.to(torch.int64).contiguous().numpy().tobytes())
    return h.digest()


def chain_hashes(ids: torch.Tensor, num_tokens: int, page_size: int = PAGE_SIZE,
                 salt: bytes | None = None) -> list[bytes]:
    """Hashes of the full pages among the first `num_tokens` ids (1-D CPU tensor); `salt` (the LoRA adapters
    that compute the K/V) stands before the first page."""
    out: list[bytes] = []
    prev: bytes | None = salt
    for p in range(num_tokens // page_size):
        prev = page_hash(prev, ids[p * page_size:(p + 1) * page_size])
        out.append(prev)
    return out


@dataclass
class CachePage:
    index: int
    phash: bytes  # content hash when `hashed`, else a random placeholder that matches nothing
    hashed: bool = False
    ref_count: int = 0
    last_access: int = 0
    kv_position: int = 0  # tokens of this page whose K/V is written and valid
    filler: int | None = None  # serial of the job currently writing this page
    # Unhashed pages given back keep what they hold, so a later prompt can copy a matching partial page:
    prev_hash: bytes | None = None  # chain hash of the page before it (first page: the LoRA salt, or None)
    tokens: torch.Tensor | None = None  # the token ids whose K/V it holds, from its start
    size: int = PAGE_SIZE

    @property
    def complete(self) -> bool:
        return self.hashed and self.kv_position == self.size


class PageTable:
    """Allocation of pages to jobs. Single-threaded: only the generator's iterate() touches it.

    The unreferenced pages are kept in the order they became free (`free`: least recently used first), so counting
    them and taking the LRU one cost O(1), not a scan of every page: a server's cache has thousands of pages, and
    32 decoding jobs crossing a page boundary in the same step took 64 such scans (~5 ms of the generator thread
    on a 1,605-page cache)."""

    def __init__(self, num_pages: int, page_size: int = PAGE_SIZE) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.pages = [CachePage(i, os.urandom(16), size=page_size) for i in range(num_pages)]
        self.by_hash: dict[bytes, CachePage] = {}
        self.clock = 0
        # index -> page for every page with ref_count 0, in the order of their last_access (all 0 at first: index
        # order, as min() over the list picked them)
        self.free: OrderedDict[int, CachePage] = OrderedDict((p.index, p) for p in self.pages)

    def reset(self) -> None:
        self.__init__(self.num_pages, self.page_size)  # type: ignore[misc]

    def num_unreferenced(self) -> int:
        return len(self.free)

    def _ref(self, page: CachePage) -> None:
        if page.ref_count == 0:
            del self.free[page.index]
        page.ref_count += 1

    def _tick(self, page: CachePage) -> None:
        self.clock += 1
        page.last_access = self.clock

    def can_allocate(self, needs: list[tuple[list[bytes], int]], reserve: int = 0) -> bool:
        """Whether sequences needing (prefix hashes, total pages) each all fit with `reserve` pages to spare,
        counting the cached prefix pages that would be shared with running jobs (they cost no free page)."""
        return self.pages_needed(needs) + reserve <= self.num_unreferenced()

    def pages_needed(self, needs: list[tuple[list[bytes], int]]) -> int:
        """Free pages that sequences needing (prefix hashes, total pages) would take."""
        need = 0
        for hashes, total_pages in needs:
            shared_live = 0
            for h in hashes:
                p = self.by_hash.get(h)
                if p is None:
                    break
                if p.ref_count > 0:
                    shared_live += 1
            need += total_pages - shared_live
        return need

    def allocate(self, hashes: list[bytes], total_pages: int, serial: int) -> tuple[list[CachePage], int]:
        """Pages for a job: reuse the cached chain of `hashes` as far as it goes, fresh LRU pages for the rest.

        Returns (pages, number of leading pages reused from the cache). Fresh pages for hashed prefix positions
        are registered under their hash at once, so a second job with the same prefix that starts before this
        one has finished prefilling references (and waits for) the same pages instead of computing them twice.
        """
        pages: list[CachePage] = []
        reused = 0
        chain_ok = True
        for i in range(total_pages):
            h = hashes[i] if i < len(hashes) else None
            page = self.by_hash.get(h) if (h is not None and chain_ok) else None
            if page is not None:
                reused += 1
            else:
                chain_ok = False
                page = self._take_free()
                if h is not None:
                    page.phash, page.hashed = h, True
                    self.by_hash[h] = page
                page.filler = serial
            self._ref(page)
            self._tick(page)
            pages.append(page)
        return pages, reused

    def grow(self, pages: list[CachePage], total_pages: int, serial: int) -> None:
        """Append fresh pages to a running sequence's list until it holds `total_pages` (decode growth)."""
        while len(pages) < total_pages:
            page = self._take_free()
            page.filler = serial
            self._ref(page)
            self._tick(page)
            pages.append(page)

    def _take_free(self) -> CachePage:
        """The least recently used unreferenced page, emptied (still in `free`: the caller references it)."""
        if not self.free:
            raise RuntimeError("page table exhausted (can_allocate() must be checked first)")
        page = next(iter(self.free.values()))
        if page.hashed and self.by_hash.get(page.phash) is page:
            del self.by_hash[page.phash]
        page.phash, page.hashed, page.kv_position, page.filler = os.urandom(16), False, 0, None
        page.prev_hash, page.tokens = None, None  # about to be overwritten
        return page

    def release(self, pages: list[CachePage], serial: int, ids: torch.Tensor | None = None,
                valid_tokens: int = 0, salt: bytes | None = None) -> None:
        """Drop a job's references. With `ids` (the job's full sequence) its full pages are hashed for reuse."""
        size = self.page_size
        hashes = chain_hashes(ids, valid_tokens, size, salt) if ids is not None else []
        for i, page in enumerate(pages):
            if page.filler == serial:
                page.filler = None  # a sharer that still holds an unfinished page claims and finishes it
            if i < len(hashes) and not page.hashed and page.ref_count == 1 and hashes[i] not in self.by_hash:
                page.phash, page.hashed, page.kv_position = hashes[i], True, size
                self.by_hash[hashes[i]] = page
            if ids is not None and page.ref_count == 1 and not page.hashed and (i == 0 or i - 1 < len(hashes)):
                held = ids[i * size:min(valid_tokens, (i + 1) * size)]
                if held.numel():
                    page.prev_hash, page.tokens = (hashes[i - 1] if i else salt), held.clone()
            if page.ref_count == 1 and page.hashed and page.kv_position < size:
                # Last holder of a prefix page nobody finished (cancelled mid-prefill): its hash would promise
                # K/V that is not there.
                self._unhash(page)
            page.ref_count -= 1
            self._tick(page)
            if page.ref_count == 0:
                self.free[page.index] = page  # the most recently used free page: taken last

    def find_partial(self, prev_hash: bytes | None, want: torch.Tensor) -> tuple[CachePage | None, int]:
        """The unreferenced page after `prev_hash` whose held tokens share the longest prefix with `want`."""
        best: CachePage | None = None
        best_n = 0
        for page in self.pages:
            if page.ref_count or page.tokens is None or page.prev_hash != prev_hash:
                continue
            m = min(page.tokens.numel(), want.numel())
            diff = (page.tokens[:m] != want[:m]).nonzero()
            n = int(diff[0, 0]) if diff.numel() else m
            if n > best_n:
                best, best_n = page, n
        return best, best_n

    def _unhash(self, page: CachePage) -> None:
        if self.by_hash.get(page.phash) is page:
            del self.by_hash[page.phash]
        page.phash, page.hashed, page.kv_position = os.urandom(16), False, 0
