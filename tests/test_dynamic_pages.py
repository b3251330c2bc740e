"""Page table unit tests: chained hashes, sharing, LRU reuse, hashing at release, unfinished pages."""

from __future__ import annotations

import torch

from exlpy.generator.dynamic.pages import PAGE_SIZE, PageTable, chain_hashes, page_hash


def ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed))


def test_chain_hash_depends_on_the_whole_prefix() -> None:
    a = ids(0, 3 * PAGE_SIZE)
    b = a.clone()
    b[5] += 1  # differs in page 0 only
    ha, hb = chain_hashes(a, len(a)), chain_hashes(b, len(b))
    assert len(ha) == 3 and all(x != y for x, y in zip(ha, hb))  # every later page differs too
    assert chain_hashes(a, 2 * PAGE_SIZE + 100) == ha[:2]
    assert ha[1] == page_hash(ha[0], a[PAGE_SIZE:2 * PAGE_SIZE])


def test_shared_prefix_pages_are_referenced_not_copied() -> None:
    t = PageTable(8)
    h = chain_hashes(ids(1, 600), 599)
    p1, r1 = t.allocate(h, 3, serial=1)
    assert r1 == 0 and t.num_unreferenced() == 5
    assert t.can_allocate([(h, 3)])  # two of the three pages would be shared
    p2, r2 = t.allocate(h, 3, serial=2)
    assert r2 == 2 and p2[:2] == p1[:2] and p2[2] is not p1[2]
    assert p1[0].ref_count == 2 and t.num_unreferenced() == 4
    assert not p1[0].complete  # registered, but its K/V is not written yet
    p1[0].kv_position = p1[1].kv_position = PAGE_SIZE
    assert p1[0].complete


def test_released_pages_stay_cached_until_lru_eviction() -> None:
    t = PageTable(4)
    seq = ids(2, 2 * PAGE_SIZE + 10)
    pages, _ = t.allocate([], 3, serial=1)  # no prompt hashes: e.g. a short prompt that generated a lot
    t.release(pages, 1, seq, valid_tokens=2 * PAGE_SIZE + 9)
    assert t.num_unreferenced() == 4
    h = chain_hashes(seq, 2 * PAGE_SIZE)
    assert pages[0].hashed and pages[1].hashed and not pages[2].hashed  # only full pages get hashed
    again, reused = t.allocate(h, 3, serial=2)
    assert reused == 2 and again[:2] == pages[:2]
    t.release(again, 2)
    # Two fresh single-page jobs: the LRU unreferenced pages go first, the cached chain is evicted last.
    other, _ = t.allocate([], 1, serial=3)
    assert other[0] is pages[2]  # least recently used; the cached chain pages were touched later
    more, _ = t.allocate([], 3, serial=4)
    assert t.num_unreferenced() == 0 and h[0] not in t.by_hash  # cache full: the chain had to go


def test_unfinished_prefix_page_is_unhashed_unless_a_sharer_can_finish_it() -> None:
    t = PageTable(4)
    h = chain_hashes(ids(3, 300), 299)
    a, _ = t.allocate(h, 2, serial=1)
    b, reused = t.allocate(h, 2, serial=2)
    assert reused == 1 and a[0] is b[0] and a[0].filler == 1
    t.release(a, 1)  # cancelled before computing page 0; job 2 still holds it
    assert b[0].hashed and b[0].filler is None  # job 2 may claim and finish it
    t.release(b, 2)
    assert not b[0].hashed and h[0] not in t.by_hash  # nobody finished it: no false promise of K/V


def test_free_pages_are_counted_and_taken_lru_without_a_scan() -> None:
    """The free list the table keeps (O(1) count and LRU page, no scan of every page per step) agrees with a scan
    of the pages after any sequence of allocations, growth, sharing and releases."""
    import random

    rng = random.Random(0)
    table = PageTable(24, 4)
    held: list[tuple[list, int]] = []
    serial = 0
    for _ in range(400):
        free = [p for p in table.pages if p.ref_count == 0]
        assert table.num_unreferenced() == len(free) == len(table.free)
        if free:  # the page the next allocation takes: the least recently used free one
            assert table._take_free() is min(free, key=lambda p: p.last_access)
        if held and (rng.random() < 0.4 or not free):
            pages, s = held.pop(rng.randrange(len(held)))
            ids = torch.randint(3, 9, (len(pages) * 4,), generator=torch.Generator().manual_seed(s))
            table.release(pages, s, ids, rng.randrange(len(pages) * 4 + 1))
        elif held and rng.random() < 0.3:
            pages, s = held[rng.randrange(len(held))]
            if len(free) >= 2:
                table.grow(pages, len(pages) + 2, s)
        else:
            serial += 1
            n = rng.randint(1, min(3, len(free)))
            ids = torch.randint(3, 5, (n * 4,), generator=torch.Generator().manual_seed(rng.randrange(4)))
            hashes = chain_hashes(ids, n * 4 - 1, 4)  # a shared prefix now and then: live pages referenced twice
            if table.can_allocate([(hashes, n)]):
                pages, _ = table.allocate(hashes, n, serial)
                held.append((pages, serial))
