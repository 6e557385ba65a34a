"""Paged KV-cache bookkeeping: a block allocator with prefix caching, and per-sequence block tables.

The cache is `num_blocks` fixed-size blocks of `block_size` token slots (PagedAttention, Kwon et al.,
SOSP 2023). A sequence's block table maps its logical block i (tokens [i*B, (i+1)*B)) to a physical
block; token at position p lives in slot `block_ids[p // B] * B + p % B`. Nothing here touches the
tensors: the runner only ever sees slot numbers, so blocks are never moved or re-laid out.

Prefix caching (as in vLLM's automatic prefix caching): a *full, computed* block is named by a hash
chained over every token up to its end. The hash is SHA-256 of the parent block's hash and the block's
tokens (as vLLM's after an unkeyed 64-bit hash let one prompt be answered with another's K/V, issue
35.3), and a hit is trusted only when the cached block's own tokens and parent hash equal the
lookup's, so even a hash collision cannot share K/V between different prompts. A request's optional
`cache_salt` starts its chain (the root "parent"), so tenants with different salts never share blocks.
Freed blocks keep their hash and stay findable until the allocator reuses them (least recently freed
first). Sharing is copy-free: a block is only ever written while its owner is the only one computing
into it, because only full blocks are shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from shiftlm.serve.engine.sequence import Sequence

ROOT = b""  # the parent hash of a sequence's first block without a cache salt


def root_hash(cache_salt: str | None) -> bytes:
    """The chain's start: empty, or a hash of the salt (so no salted chain meets an unsalted one)."""
    if cache_salt is None:
        return ROOT
    return hashlib.sha256(b"shiftlm-cache-salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def block_hash(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """SHA-256 of a full block, chained on the previous block's hash (tokens as int64)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class BlockAllocator:
    """Reference-counted physical blocks; free blocks with a hash double as the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # reuse from the front
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self._key_of_block: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # (parent hash, tokens)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self) -> int:
        block = next(iter(self._free))  # raises StopIteration only if the caller skipped num_free
        del self._free[block]
        old_hash = self._hash_of_block.pop(block, None)
        if old_hash is not None:
            del self._block_of_hash[old_hash]  # evicted from the prefix cache
            del self._key_of_block[block]
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None
            if block not in self._hash_of_block:
                self._free.move_to_end(block, last=False)  # nothing to keep: reuse it first

    def cached_block(self, hash_value: bytes, parent_hash: bytes, token_ids: list[int]) -> int | None:
        """The cached block named `hash_value`, if it holds exactly these tokens after this parent."""
        block = self._block_of_hash.get(hash_value)
        if block is None or self._key_of_block[block] != (parent_hash, tuple(token_ids)):
            return None  # a miss, or a collision: never another prompt's K/V
        return block

    def register(self, block: int, hash_value: bytes, parent_hash: bytes, token_ids: list[int]) -> None:
        if hash_value not in self._block_of_hash and block not in self._hash_of_block:
            self._block_of_hash[hash_value] = block
            self._hash_of_block[block] = hash_value
            self._key_of_block[block] = (parent_hash, tuple(token_ids))


class BlockManager:
    """Grows, shares and releases the block tables of sequences."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_hits = 0  # tokens whose K/V came from the prefix cache

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its first `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))

    def reuse_cached_prefix(self, seq: Sequence) -> None:
        """Point a fresh sequence at cached blocks of its prefix; always leave >= 1 token to compute."""
        if not self.enable_prefix_caching or seq.block_ids:
            return
        tokens = seq.token_ids
        parent = root_hash(seq.params.cache_salt)
        limit = min(len(tokens) - 1, seq.num_cacheable)
        while (len(seq.block_ids) + 1) * self.block_size <= limit:
            start = len(seq.block_ids) * self.block_size
            block_tokens = tokens[start : start + self.block_size]
            hash_value = block_hash(parent, block_tokens)
            block = self.allocator.cached_block(hash_value, parent, block_tokens)
            if block is None:
                break
            self.allocator.share(block)
            seq.block_ids.append(block)
            seq.block_hashes.append(hash_value)
            parent = hash_value
        seq.num_hashed_blocks = len(seq.block_ids)
        seq.num_computed = len(seq.block_ids) * self.block_size
        self.prefix_hits += seq.num_computed

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` slots for its first `num_tokens` tokens; all or nothing."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.allocator.num_free:
            return False
        seq.block_ids.extend(self.allocator.allocate() for _ in range(needed))
        return True

    def commit_computed_blocks(self, seq: Sequence, computed: int) -> None:
        """Offer every newly full block of `seq` within its first `computed` tokens (K/V written,
        every token known) to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        tokens = seq.token_ids
        limit = min(computed, seq.num_cacheable, len(tokens))
        while (seq.num_hashed_blocks + 1) * self.block_size <= limit:
            i = seq.num_hashed_blocks
            parent = seq.block_hashes[i - 1] if i else root_hash(seq.params.cache_salt)
            block_tokens = tokens[i * self.block_size : (i + 1) * self.block_size]
            hash_value = block_hash(parent, block_tokens)
            self.allocator.register(seq.block_ids[i], hash_value, parent, block_tokens)
            seq.block_hashes.append(hash_value)
            seq.num_hashed_blocks += 1

    def release(self, seq: Sequence) -> None:
        """Free the blocks of a finished or preempted sequence (cached ones stay findable)."""
        for block in reversed(seq.block_ids):  # the tail is freed first, so it is evicted first
            self.allocator.free(block)
        seq.block_ids = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed = 0
        seq.num_blocks_sent = 0
