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
        op = data.draw(st.sampled_from(["pop", "prepend", "append", "remove"]))
        if op == "pop":
            n = data.draw(st.integers(0, len(model.items)))
            ids, first_linked = queue.popleft_n(n)
            assert ids == model.popleft_n(n)
            # Ids from the LRU region are exactly the appended ones among them.
            assert all(b in appended for b in ids[first_linked:])
            appended.difference_update(ids)
            out.extend(ids)
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
