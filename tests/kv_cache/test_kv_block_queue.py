from __future__ import annotations

import pytest

from kv_cache import FreeBlockQueue, KVCacheBlock


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def ids(queue: FreeBlockQueue) -> list[int]:
    return [block.block_id for block in queue]


def test_initial_order_and_len() -> None:
    _, queue = make_queue(5)
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert len(queue) == 5
    queue.check_links()


def test_popleft_takes_the_head_and_unlinks_it() -> None:
    blocks, queue = make_queue(3)
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    assert ids(queue) == [1, 2]
    assert len(queue) == 2
    queue.check_links()


def test_popleft_until_empty_then_raises() -> None:
    _, queue = make_queue(2)
    queue.popleft()
    queue.popleft()
    assert len(queue) == 0 and ids(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()
    queue.check_links()


def test_append_goes_to_the_tail() -> None:
    blocks, queue = make_queue(3)
    head = queue.popleft()
    queue.append(head)
    assert ids(queue) == [1, 2, 0]
    queue.check_links()


def test_append_to_an_empty_queue() -> None:
    block = KVCacheBlock(7)
    queue = FreeBlockQueue()
    queue.append(block)
    assert ids(queue) == [7] and len(queue) == 1
    queue.check_links()


def test_append_twice_is_refused() -> None:
    blocks, queue = make_queue(2)
    with pytest.raises(ValueError):
        queue.append(blocks[1])
    assert ids(queue) == [0, 1]


@pytest.mark.parametrize(
    ("victim", "left"),
    [(0, [1, 2, 3]), (2, [0, 1, 3]), (3, [0, 1, 2])],
    ids=["head", "middle", "tail"],
)
def test_remove(victim: int, left: list[int]) -> None:
    blocks, queue = make_queue(4)
    queue.remove(blocks[victim])
    assert ids(queue) == left
    assert len(queue) == 3
    assert blocks[victim].prev_free is None and blocks[victim].next_free is None
    queue.check_links()
    # The queue stays usable at both ends after a removal.
    queue.append(blocks[victim])
    assert ids(queue) == [*left, victim]
    assert queue.popleft().block_id == left[0]
    queue.check_links()


def test_remove_of_the_only_block() -> None:
    blocks, queue = make_queue(1)
    queue.remove(blocks[0])
    assert len(queue) == 0 and ids(queue) == []
    queue.check_links()


def test_remove_a_block_not_in_the_queue_is_refused() -> None:
    blocks, queue = make_queue(2)
    queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[0])
    assert ids(queue) == [1]


def test_check_links_catches_a_broken_back_link() -> None:
    blocks, queue = make_queue(3)
    blocks[2].prev_free = blocks[0]
    with pytest.raises(AssertionError, match="block 2"):
        queue.check_links()


def test_block_repr_does_not_walk_the_list() -> None:
    blocks, _ = make_queue(3)
    assert repr(blocks[1]) == "KVCacheBlock(block_id=1, ref_cnt=0, block_hash=None)"
    assert blocks[0] != KVCacheBlock(0)  # identity, not field equality
