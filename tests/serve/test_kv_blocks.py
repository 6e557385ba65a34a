from shiftlm.serve.kv_blocks import BlockAllocator, BlockManager
from shiftlm.serve.sequence import SamplingParams, Sequence


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def _compute_all(manager: BlockManager, seq: Sequence) -> None:
    assert manager.allocate(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    manager.commit_computed_blocks(seq)


def test_a_freed_full_block_is_found_again_by_its_prefix():
    manager = BlockManager(num_blocks=8, block_size=4)
    first = _seq(list(range(10)))
    _compute_all(manager, first)
    cached = first.block_ids[:2]
    manager.release(first)
    second = _seq(list(range(9)) + [99, 98])
    manager.reuse_cached_prefix(second)
    assert second.block_ids == cached and second.num_computed == 8


def test_prefix_reuse_always_leaves_a_token_to_compute():
    manager = BlockManager(num_blocks=8, block_size=4)
    first = _seq(list(range(8)))
    _compute_all(manager, first)
    manager.release(first)
    again = _seq(list(range(8)))
    manager.reuse_cached_prefix(again)
    assert again.num_computed == 4  # the last block is recomputed so its logits exist


def test_a_different_earlier_block_means_no_reuse_of_later_equal_blocks():
    manager = BlockManager(num_blocks=8, block_size=4)
    first = _seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    _compute_all(manager, first)
    other = _seq([0, 2, 3, 4, 5, 6, 7, 8, 9])
    manager.reuse_cached_prefix(other)
    assert other.num_computed == 0


def test_allocation_is_all_or_nothing():
    manager = BlockManager(num_blocks=3, block_size=4)
    seq = _seq(list(range(16)))
    assert not manager.allocate(seq, 16)
    assert seq.block_ids == [] and manager.allocator.num_free == 3


def test_a_shared_block_returns_to_the_pool_only_after_its_last_owner():
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    block = allocator.allocate()
    allocator.share(block)
    allocator.free(block)
    assert allocator.num_free == 1
    allocator.free(block)
    assert allocator.num_free == 2


def test_reallocating_a_cached_block_evicts_it_from_the_prefix_cache():
    allocator = BlockAllocator(num_blocks=1, block_size=4)
    block = allocator.allocate()
    allocator.register(block, 1234)
    allocator.free(block)
    assert allocator.cached_block(1234) == block
    allocator.allocate()
    assert allocator.cached_block(1234) is None
