from shiftlm.serve.engine.kv_blocks import BlockAllocator, BlockManager
from shiftlm.serve.engine.sequence import SamplingParams, Sequence


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def _compute_all(manager: BlockManager, seq: Sequence) -> None:
    assert manager.allocate(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    manager.commit_computed_blocks(seq, seq.num_computed)


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
    allocator.register(block, b"h", b"", [1, 2, 3, 4])
    allocator.free(block)
    assert allocator.cached_block(b"h", b"", [1, 2, 3, 4]) == block
    allocator.allocate()
    assert allocator.cached_block(b"h", b"", [1, 2, 3, 4]) is None


def test_a_hash_collision_never_shares_another_prompts_blocks(monkeypatch):
    """Issue 35.3: two different blocks with equal hashes (planted: every block hashes alike, as two
    colliding blocks under the old unkeyed 64-bit hash did) are told apart by their tokens."""
    from shiftlm.serve.engine import kv_blocks

    monkeypatch.setattr(kv_blocks, "block_hash", lambda parent, tokens: b"collide")
    manager = BlockManager(num_blocks=8, block_size=4)
    first = _seq([1, 2, 3, 4, 5])
    _compute_all(manager, first)
    manager.release(first)
    second = _seq([9, 9, 9, 9, 5])  # same (planted) hash, other tokens
    manager.reuse_cached_prefix(second)
    assert second.num_computed == 0 and second.block_ids == []
    again = _seq([1, 2, 3, 4, 6])  # the same tokens are still found
    manager.reuse_cached_prefix(again)
    assert again.num_computed == 4


def test_block_hashes_are_sha256_chains_and_a_cache_salt_separates_tenants():
    import hashlib
    from array import array

    from shiftlm.serve.engine.kv_blocks import block_hash, root_hash

    assert block_hash(b"", [1, 2]) == hashlib.sha256(array("q", [1, 2]).tobytes()).digest()
    assert block_hash(block_hash(b"", [1]), [2]) != block_hash(block_hash(b"", [3]), [2])
    manager = BlockManager(num_blocks=8, block_size=4)
    alice = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(cache_salt="alice"))
    _compute_all(manager, alice)
    manager.release(alice)
    for salt, hit in ((None, 0), ("bob", 0), ("alice", 4)):
        seq = Sequence("b", [1, 2, 3, 4, 5], SamplingParams(cache_salt=salt))
        manager.reuse_cached_prefix(seq)
        assert seq.num_computed == hit, salt
        manager.release(seq)
    assert root_hash("x") != root_hash("y") != root_hash(None)
