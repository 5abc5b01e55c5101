"""FreeBlockQueue: the reference's single eviction-order queue, kept as three regions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core import FreeBlockQueue


def test_initial_order_is_by_id_without_the_null_block() -> None:
    queue = FreeBlockQueue(6)
    assert queue.num_free_blocks == 5
    assert list(queue) == [1, 2, 3, 4, 5]


def test_popleft_n_takes_the_front_and_says_where_linked_ids_start() -> None:
    queue = FreeBlockQueue(6)
    assert queue.popleft_n(2) == ([1, 2], 2)
    queue.append_n([1])
    # Untouched ids come before appended ones.
    assert queue.popleft_n(4) == ([3, 4, 5, 1], 3)
    assert queue.num_free_blocks == 0
    assert list(queue) == []


def test_prepend_puts_the_first_id_at_the_very_front() -> None:
    queue = FreeBlockQueue(8)
    queue.popleft_n(7)
    queue.append_n([7, 6])
    queue.prepend_n([3, 1])
    queue.prepend_n([5])
    assert list(queue) == [5, 3, 1, 7, 6]
    assert queue.popleft_n(3) == ([5, 3, 1], 3)
    assert queue.popleft_n(2) == ([7, 6], 0)


def test_remove_unlinks_from_the_middle_of_the_lru_region() -> None:
    queue = FreeBlockQueue(6)
    queue.popleft_n(5)
    queue.append_n([4, 2, 5, 1])
    queue.remove(2)
    queue.remove(1)
    assert list(queue) == [4, 5]
    assert not queue.is_linked(2)
    assert queue.is_linked(5)
    queue.append_n([2])
    assert list(queue) == [4, 5, 2]


def test_remove_of_an_unlinked_block_is_a_bug() -> None:
    queue = FreeBlockQueue(4)
    with pytest.raises(AssertionError):
        queue.remove(2)  # still in the untouched range, never appended


def test_popping_one_linked_id_from_an_empty_region_raises() -> None:
    queue = FreeBlockQueue(4)
    queue.popleft_n(3)
    queue.prepend_n([2])
    with pytest.raises(ValueError, match="empty free queue"):
        queue.popleft_linked()  # the stack holds one, the LRU region none
    queue.append_n([1])
    assert queue.popleft_linked() == 1
    assert list(queue) == [2]
    # The region emptied by that pop takes appends again, front to back.
    queue.append_n([1, 3])
    assert list(queue) == [2, 1, 3]
    assert queue.page(1, 2) == [1, 3]


def test_popping_more_than_is_free_raises() -> None:
    queue = FreeBlockQueue(4)
    queue.popleft_n(2)
    queue.prepend_n([2])
    with pytest.raises(ValueError, match="cannot pop 4"):
        queue.popleft_n(4)


class _ListQueue:
    """The reference's queue as a plain list."""

    def __init__(self, num_blocks: int) -> None:
        self.items = list(range(1, num_blocks))

    def popleft_n(self, n: int) -> list[int]:
        taken, self.items = self.items[:n], self.items[n:]
        return taken

    def prepend_n(self, ids: list[int]) -> None:
        self.items = ids + self.items

    def append_n(self, ids: list[int]) -> None:
        self.items = self.items + ids

    def remove(self, block_id: int) -> None:
        self.items.remove(block_id)


@settings(deadline=None, max_examples=150)
@given(st.data())
def test_same_order_as_a_single_list_under_random_operations(data: st.DataObject) -> None:
    num_blocks = data.draw(st.integers(2, 24))
    queue = FreeBlockQueue(num_blocks)
    model = _ListQueue(num_blocks)
    out: list[int] = []  # popped ids, free to put back
    appended: set[int] = set()  # ids put back with append (removable)
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["pop", "pop1", "prepend", "append", "remove", "page"]))
        if op == "page":
            # Any window of the queue, read from wherever the cursor was left.
            offset = data.draw(st.integers(0, num_blocks + 2))
            limit = data.draw(st.integers(0, num_blocks + 2))
            assert queue.page(offset, limit) == model.items[offset : offset + limit]
        elif op == "pop":
            n = data.draw(st.integers(0, len(model.items)))
            ids, first_linked = queue.popleft_n(n)
            assert ids == model.popleft_n(n)
            # Ids from the LRU region are exactly the appended ones among them.
            assert all(b in appended for b in ids[first_linked:])
            appended.difference_update(ids)
            out.extend(ids)
        elif op == "pop1" and model.items:
            # One id as a decode step takes it: from the stack or the untouched range,
            # else the LRU region's head.
            block_id = queue.popleft_fresh()
            if block_id:
                assert block_id not in appended
            else:
                block_id = queue.popleft_linked()
                assert block_id in appended
            assert [block_id] == model.popleft_n(1)
            appended.discard(block_id)
            out.append(block_id)
        elif op in ("prepend", "append") and out:
            chosen = data.draw(st.lists(st.sampled_from(out), unique=True, max_size=len(out)))
            for b in chosen:
                out.remove(b)
            if op == "prepend":
                queue.prepend_n(chosen)
                model.prepend_n(chosen)
            else:
                queue.append_n(chosen)
                model.append_n(chosen)
                appended.update(chosen)
        elif op == "remove" and appended:
            block_id = data.draw(st.sampled_from(sorted(appended)))
            queue.remove(block_id)
            model.remove(block_id)
            appended.discard(block_id)
            out.append(block_id)
        assert list(queue) == model.items
        assert queue.num_free_blocks == len(model.items)


def lru_queue(num_linked: int) -> FreeBlockQueue:
    """A queue whose every free id is in the LRU region (a pool that cached everything),
    in the order ``num_linked, num_linked - 1, ..., 1``."""
    queue = FreeBlockQueue(num_linked + 1)
    queue.popleft_n(num_linked)
    queue.append_n(range(num_linked, 0, -1))
    return queue


def test_reading_the_queue_page_after_page_walks_nothing() -> None:
    """Regression (issue 32): a page at offset k of the LRU region walked k links, on the
    event loop (0.4-0.9 s for an offset deep in a 4M-block pool). Each page now starts
    where the last one ended: reading the whole queue costs O(queue), and a page O(page)."""
    queue = lru_queue(300_000)
    order: list[int] = []
    while True:
        assert queue.page_walk(len(order), 65536) <= 1  # one link past the last page
        page = queue.page(len(order), 65536)
        order.extend(page)
        if len(page) < 65536:
            break
    assert order == list(range(300_000, 0, -1))


def test_a_page_starts_from_the_nearest_of_front_back_and_cursor() -> None:
    queue = lru_queue(1000)
    assert queue.page_walk(10, 3) == 10  # from the front
    assert queue.page_walk(990, 3) == 7  # from the back, reading backward
    assert queue.page(990, 3) == [10, 9, 8]
    assert queue.page(400, 3) == [600, 599, 598]
    assert queue.page_walk(402, 3) == 0  # the cursor (the page's last id)
    assert queue.page_walk(380, 2) == 21  # from the cursor, reading backward
    assert queue.page(380, 2) == [620, 619]
    queue.append_n([])
    assert queue.page_walk(381, 2) == 0  # an append keeps every position
    queue.remove(500)  # a remove shifts them: the cursor is gone
    assert queue.page_walk(381, 2) == 381
    assert queue.page(381, 2) == [619, 618]
    queue.popleft_n(1)  # so does a pop from the region
    assert queue.page_walk(381, 2) == 381
    assert queue.page(381, 2) == [618, 617]
    assert queue.page(5000, 10) == [] and queue.page_walk(5000, 10) == 0


def test_a_page_after_a_decode_took_the_lru_head_reads_the_queue_as_it_is() -> None:
    """A pop from the LRU region moves every position in it: the cursor the last page
    left must not be used after one."""
    queue = lru_queue(8)  # 8, 7, ..., 1
    assert queue.page(2, 2) == [6, 5]  # leaves the cursor at position 3 (block 5)
    assert queue.popleft_fresh() == 0
    assert queue.popleft_linked() == 8
    assert queue.page(2, 2) == [5, 4]
    assert queue.page(0, 7) == [7, 6, 5, 4, 3, 2, 1]
