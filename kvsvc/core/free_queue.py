"""The free queue: free block ids in the order they are evicted (vLLM's
``FreeKVCacheBlockQueue``), kept in flat arrays rather than linked block objects."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from librt.vecs import vec
from mypy_extensions import i32


def _links(values: Iterable[int]) -> vec[i32]:
    """A link array: ``vec[i32]``, mypyc's native array of 32-bit ints (``librt``).

    Compiled, reading or writing one of its items is a native load or store (~1 ns);
    ``array("i")``'s, which these were, went through the generic item protocol with a
    boxed index (~100-350 instructions each, ``callgrind``): an admission's 64 new blocks,
    its prefix hits leaving the queue and its freed blocks joining it are a few hundred
    such accesses: 31% of a 2048-token admission's instructions went with them
    (``benchmarks/instruction_counts.py``). Same 4 bytes an id.
    """
    return vec[i32](values)


class FreeBlockQueue:
    """Free block ids in eviction order, with O(1) pop, prepend, append and remove.

    The reference keeps one doubly linked list; this keeps the same order as three regions
    that concatenate to it::

        front (allocated first)                                          back (kept longest)
        | stack: prepended ids |  ids lo .. N-1 never handed out  |  LRU: ids appended, linked |

    ``prepend_n`` pushes onto the stack, ``append_n`` links at the LRU tail, ``popleft_n``
    takes from the stack, then the untouched range, then the LRU head. Because the regions
    only grow at the outer ends, their concatenation behaves exactly like the single queue.
    ``remove`` applies to LRU entries only: the pool removes just cached blocks (a prefix
    hit), and only blocks freed with a hash are appended.

    Args:
        num_blocks: pool size including the null block, which is never in the queue.
    """

    __slots__ = (
        "_cursor_block",
        "_cursor_pos",
        "_lo",
        "_next",
        "_num_linked",
        "_prev",
        "_sentinel",
        "_stack",
        "num_blocks",
    )

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self._stack: list[int] = []
        self._lo = 1
        # Index ``num_blocks`` is the list's sentinel (head = next[S], tail = prev[S]);
        # next[b] == 0 means "b is not linked" (0 is the null block, never linked).
        sentinel = num_blocks
        self._sentinel = sentinel
        self._next = _links([0] * (num_blocks + 1))
        self._prev = _links([0] * (num_blocks + 1))
        self._next[sentinel] = sentinel
        self._prev[sentinel] = sentinel
        self._num_linked = 0
        # Where the last page read of the LRU region ended (its position in that region
        # and its block), so reading the queue page after page walks each link once.
        # NOTE: valid while the region's order and positions stand: an append keeps them;
        # a pop from it, a remove and a load end it (``_cursor_pos = -1``).
        self._cursor_pos = -1
        self._cursor_block = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._stack) + (self.num_blocks - self._lo) + self._num_linked

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft_n(self, n: int) -> tuple[list[int], int]:
        """Pop the first ``n`` ids.

        Raises:
            ValueError: fewer than ``n`` free ids.

        Returns:
            The ids in queue order, and the index in that list where ids from the LRU region
            start (``n`` when none did): only those can still carry a cached hash.
        """
        stack = self._stack
        k = len(stack)
        if n <= k:
            ids = stack[k - n :]
            del stack[k - n :]
            ids.reverse()
            return ids, n
        if n > self.num_free_blocks or n < 0:
            raise ValueError(f"cannot pop {n} blocks from {self.num_free_blocks} free ones")
        ids = stack[::-1]
        stack.clear()
        take = min(n - k, self.num_blocks - self._lo)
        if take:
            ids.extend(range(self._lo, self._lo + take))
            self._lo += take
        first_linked = len(ids)
        if first_linked < n:
            self._cursor_pos = -1
            nxt = self._next
            prv = self._prev
            sentinel = self._sentinel
            b: int = nxt[sentinel]
            for _ in range(n - first_linked):
                ids.append(b)
                following: int = nxt[b]
                nxt[b] = 0
                b = following
            nxt[sentinel] = b
            prv[b] = sentinel
            self._num_linked -= n - first_linked
        return ids, first_linked

    def popleft_fresh(self) -> int:
        """Pop the first id if it comes from the stack or the untouched range, else 0.

        The one-block case of a decode step: such ids never carry a hash, so the caller
        needs no eviction; 0 (the null block, never queued) means "use ``popleft_n``".
        """
        stack = self._stack
        if stack:
            return stack.pop()
        lo = self._lo
        if lo < self.num_blocks:
            self._lo = lo + 1
            return lo
        return 0

    def popleft_linked(self) -> int:
        """Pop the head of the LRU region (``popleft_fresh`` found the others empty).

        The one-block case of a decode step once the pool has cycled: no list is built.

        Raises:
            ValueError: the LRU region is empty too.
        """
        nxt = self._next
        sentinel = self._sentinel
        block_id: int = nxt[sentinel]
        if block_id == sentinel:
            raise ValueError("cannot pop a block from an empty free queue")
        following: int = nxt[block_id]
        nxt[block_id] = 0
        nxt[sentinel] = following
        self._prev[following] = sentinel
        self._num_linked -= 1
        self._cursor_pos = -1
        return block_id

    def prepend_n(self, ids: Sequence[int]) -> None:
        """Put ``ids`` at the front, ``ids[0]`` first (they will be reused first)."""
        self._stack.extend(reversed(ids))

    def append_n(self, ids: Iterable[int]) -> None:
        """Put ``ids`` at the back in order (``ids[-1]`` is kept longest)."""
        nxt = self._next
        prv = self._prev
        sentinel = self._sentinel
        last: int = prv[sentinel]
        count = 0
        for b in ids:
            nxt[last] = b
            prv[b] = last
            last = b
            count += 1
        nxt[last] = sentinel
        prv[sentinel] = last
        self._num_linked += count

    def remove(self, block_id: int) -> None:
        """Take a block that was appended (and not popped since) out of the queue."""
        nxt = self._next
        prv = self._prev
        following: int = nxt[block_id]
        assert following != 0, f"block {block_id} is not in the free queue's LRU region"
        before: int = prv[block_id]
        nxt[before] = following
        prv[following] = before
        nxt[block_id] = 0
        self._num_linked -= 1
        self._cursor_pos = -1

    def is_linked(self, block_id: int) -> bool:
        """Whether ``block_id`` is in the LRU region (O(1); for assertions and tests)."""
        return self._next[block_id] != 0

    def __iter__(self) -> Iterator[int]:
        """All free ids in eviction order (O(n): for tests and diagnostics)."""
        yield from reversed(self._stack)
        yield from range(self._lo, self.num_blocks)
        nxt = self._next
        b: int = nxt[self._sentinel]
        while b != self._sentinel:
            yield b
            b = nxt[b]

    def get_all_free_blocks(self) -> list[int]:
        return list(self)

    def _linked_range(self, offset: int, limit: int) -> tuple[int, int]:
        """The part ``[k, e)`` of the LRU region a page of ``limit`` ids from ``offset``
        covers (``k >= e``: none)."""
        before = len(self._stack) + (self.num_blocks - self._lo)
        k = max(0, offset - before)
        return k, min(self._num_linked, max(0, offset + limit - before))

    def _linked_plan(self, k: int, e: int) -> tuple[int, int, int]:
        """How a page reaches ``[k, e)`` of the LRU region: the links it walks first, the
        block it starts from, and how: 0 forward from it to ``k`` then reading forward;
        1 backward from it to ``e - 1`` then reading backward; 2 backward to ``k`` then
        reading forward. From the region's front, its back, or the cursor."""
        plan = (k, self._next[self._sentinel], 0)
        back = self._num_linked - e
        if back < plan[0]:
            plan = (back, self._prev[self._sentinel], 1)
        cursor = self._cursor_pos
        if cursor >= 0:
            block = self._cursor_block
            if cursor <= k:
                here = (k - cursor, block, 0)
            elif cursor >= e - 1:
                here = (cursor - (e - 1), block, 1)
            else:
                here = (cursor - k, block, 2)
            if here[0] < plan[0]:
                plan = here
        return plan

    def page_walk(self, offset: int, limit: int) -> int:
        """The links :meth:`page` must follow before it reads the ``limit`` ids from
        position ``offset`` (O(1)).

        The stack and the untouched range are indexed directly; inside the LRU region a
        page starts from whichever is nearest of its front, its back (reading backward)
        and the cursor the previous page left (links run both ways), so reading the
        queue page after page, with no change in between, walks nothing.
        """
        k, e = self._linked_range(offset, limit)
        return self._linked_plan(k, e)[0] if k < e else 0

    def page(self, offset: int, limit: int) -> list[int]:
        """``limit`` free ids from position ``offset`` of the queue, in eviction order.

        Costs O(``limit`` + :meth:`page_walk`), not O(``offset``): the caller bounds the
        walk (a far position of a long LRU region is a walk of millions of links).
        """
        out: list[int] = []
        if limit <= 0 or offset < 0:
            return out
        stack = self._stack
        s = len(stack)
        end = offset + limit
        if offset < s:  # the stack's top is the queue's front
            out.extend(reversed(stack[max(0, s - end) : s - offset]))
        lo, n = self._lo, self.num_blocks
        r = n - lo
        if offset < s + r and end > s:
            out.extend(range(lo + max(0, offset - s), lo + min(r, end - s)))
        k, e = self._linked_range(offset, limit)
        if k >= e:
            return out
        steps, b, how = self._linked_plan(k, e)
        nxt, prv = self._next, self._prev
        links = nxt if how == 0 else prv
        for _ in range(steps):
            b = links[b]
        run = [b]
        links = prv if how == 1 else nxt
        for _ in range(e - k - 1):
            b = links[b]
            run.append(b)
        if how == 1:
            run.reverse()
        out.extend(run)
        self._cursor_pos = e - 1
        self._cursor_block = run[-1]
        return out

    def load_order(self, order: Sequence[int]) -> None:
        """Make the queue hold exactly ``order`` (front first), as prepended ids: the
        caller guarantees every free id appears once and no id is held."""
        n = self.num_blocks
        self._cursor_pos = -1
        self._stack[:] = list(reversed(order))
        self._lo = n
        self._next = _links([0] * (n + 1))
        self._prev = _links([0] * (n + 1))
        self._next[n] = n
        self._prev[n] = n
        self._num_linked = 0

    # -- state (persistence) -----------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The queue exactly as it is: the three regions and the raw link arrays.

        The arrays are copied whole (stale ``prev`` entries of unlinked ids included), so
        a queue loaded from this state is indistinguishable from this one.
        """
        return {
            "num_blocks": self.num_blocks,
            "stack": array("i", self._stack),
            "lo": self._lo,
            "next": array("i", self._next),
            "prev": array("i", self._prev),
            "num_linked": self._num_linked,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Take over ``state`` (from :meth:`to_state` of a queue of the same size).

        Raises:
            ValueError: a state of another size or with inconsistent regions.
        """
        n = self.num_blocks
        if state["num_blocks"] != n:
            raise ValueError(f"free queue of {state['num_blocks']} blocks loaded into one of {n}")
        nxt, prv, stack = state["next"], state["prev"], state["stack"]
        if len(nxt) != n + 1 or len(prv) != n + 1:
            raise ValueError("free queue link arrays have the wrong length")
        lo, num_linked = state["lo"], state["num_linked"]
        if not 1 <= lo <= n or not 0 <= num_linked < n or len(stack) + (n - lo) + num_linked >= n:
            raise ValueError("free queue regions are inconsistent")
        self._cursor_pos = -1
        self._stack[:] = list(stack)
        self._lo = lo
        self._next = _links(nxt)
        self._prev = _links(prv)
        self._num_linked = num_linked
