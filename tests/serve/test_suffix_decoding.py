"""Suffix decoding (`"method": "suffix"`, engine/suffix_tree.py): the tries count what they should,
forget what they should, and drafts come from the request's own tokens and from earlier outputs of
the same cache salt only. That its drafts leave every output unchanged: test_speculative.py."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.errors import ConfigError
from shiftlm.serve.engine.sequence import SamplingParams, Sequence
from shiftlm.serve.engine.speculative import SpeculativeConfig
from shiftlm.serve.engine.suffix_tree import SuffixProposer, SuffixTrie


def _counts(trie: SuffixTrie) -> Counter:
    out, stack = Counter(), [((), 0)]
    while stack:
        path, node = stack.pop()
        for token, child in trie.children(node):
            out[(*path, token)] = trie.count[child]
            stack.append(((*path, token), child))
    return out


def _substrings(sequences, depth: int) -> Counter:
    out = Counter()
    for seq in sequences:
        for end in range(1, len(seq) + 1):
            for n in range(1, min(depth, end) + 1):
                out[tuple(seq[end - n : end])] += 1
    return out


@settings(max_examples=200, deadline=None)
@given(
    sequences=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=4),
    depth=st.integers(2, 6),
    cut=st.integers(0, 20),
)
def test_the_trie_counts_every_substring_up_to_its_depth_and_forgets_removed_ones(sequences, depth, cut):
    trie = SuffixTrie(depth)
    for seq in sequences:  # added in two pieces, as a request's trie grows
        active = trie.add(seq[:cut])
        trie.add(seq[cut:], active)
    assert _counts(trie) == _substrings(sequences, depth)
    trie.remove(sequences[0])
    assert _counts(trie) == _substrings(sequences[1:], depth)
    for seq in sequences[1:]:
        trie.remove(seq)
    assert trie.num_nodes == 1 and not trie.branches and trie.token[0] == -1  # every node freed
    trie.add(sequences[0])  # freed nodes are reused
    assert _counts(trie) == _substrings(sequences[:1], depth)


def _seq(tokens, salt=None, seq_id=None) -> Sequence:
    seq = Sequence("r", list(tokens), SamplingParams(cache_salt=salt))
    if seq_id is not None:
        seq.seq_id = seq_id
    return seq


def _proposer(**options) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig.parse({"method": "suffix", **options}))


def test_a_request_drafts_the_repeat_of_its_own_tokens_and_further_for_a_longer_match():
    proposer = _proposer(suffix_decoding_max_tree_depth=12)
    assert proposer.propose(_seq([5, 6, 7, 8, 9, 1, 5, 6]), 10) == [7, 8]  # match of 2: factor 1 x 2
    assert proposer.propose(_seq([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8]), 10) == [9, 1, 2, 5]  # match of 4
    assert proposer.propose(_seq([1, 2, 3, 4]), 10) == []  # nothing repeats
    assert proposer.propose(_seq([5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8]), 1) == [9]  # the step's limit


def test_finished_outputs_draft_for_later_requests_of_the_same_salt_only():
    proposer = _proposer(suffix_decoding_max_cached_requests=2)
    done = _seq([1, 2], seq_id=100)
    done.output_ids[:] = [10, 11, 12, 13, 14, 15]
    proposer.finished(done)
    assert proposer.propose(_seq([3, 10, 11, 12]), 8) == [13, 14, 15]
    assert proposer.propose(_seq([3, 10, 11, 12], salt="tenant-b"), 8) == []  # another tenant's
    for i, start in enumerate((20, 30)):  # two more outputs: the first one leaves (FIFO)
        other = _seq([1], seq_id=200 + i)
        other.output_ids[:] = [start, start + 1, start + 2]
        proposer.finished(other)
    assert proposer.propose(_seq([3, 10, 11, 12]), 8) == []
    assert proposer.propose(_seq([4, 30, 31]), 8) == [32]


def test_an_unlikely_continuation_is_not_drafted():
    proposer = _proposer(suffix_decoding_min_token_prob=0.4)
    # after "7" came 1, 2, 3, 4 once each: no next token reaches 0.4
    assert proposer.propose(_seq([7, 1, 7, 2, 7, 3, 7, 4, 7]), 5) == []
    assert _proposer(suffix_decoding_min_token_prob=0.2).propose(_seq([7, 1, 7, 2, 7, 3, 7, 4, 7]), 5)


def test_the_suffix_config_takes_vllms_keys_and_defaults():
    config = SpeculativeConfig.parse('{"method": "suffix"}')
    assert (config.num_speculative_tokens, config.suffix_decoding_max_tree_depth) == (24, 24)
    assert (
        config.suffix_decoding_min_token_prob == 0.1 and config.suffix_decoding_max_cached_requests == 10000
    )
    for text, words in {
        '{"method": "suffix", "prompt_lookup_max": 3}': "unknown key(s) prompt_lookup_max for method suffix",
        '{"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 3}': "for method ngram",
        '{"method": "suffix", "suffix_decoding_min_token_prob": 2}': "must be a number in [0, 1]",
        '{"method": "suffix", "suffix_decoding_max_tree_depth": 1}': "integer in [2, 64]",
    }.items():
        with pytest.raises(ConfigError, match="--speculative-config") as err:
            SpeculativeConfig.parse(text)
        assert words in str(err.value)


def test_a_long_prompt_is_indexed_over_several_steps_and_drafts_meanwhile(monkeypatch):
    from shiftlm.serve.engine import suffix_tree

    monkeypatch.setattr(suffix_tree, "INDEX_PER_STEP", 4)
    proposer = _proposer(suffix_decoding_max_tree_depth=12)
    seq = _seq([5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7, 8])
    assert proposer.propose(seq, 10) == []  # "5 6 7 8" indexed: nothing followed it yet
    assert proposer.propose(seq, 10) == [9, 1, 2, 3]  # 8 tokens in: the context's end, walked
    assert seq.speculation.added == 8
    assert proposer.propose(seq, 10) == [9, 1, 2, 3]  # whole: the match of 4 drafts 4
    assert seq.speculation.added == len(seq.token_ids)


def test_the_shared_tries_keep_to_their_node_bound(monkeypatch):
    from shiftlm.serve.engine import suffix_tree

    monkeypatch.setattr(suffix_tree, "MAX_SHARED_NODES", 200)
    proposer = _proposer(suffix_decoding_max_tree_depth=8)
    for i in range(10):  # outputs that share nothing: ~8 nodes a token
        done = _seq([1], salt=f"s{i % 2}", seq_id=300 + i)
        done.output_ids[:] = list(range(100 + 20 * i, 100 + 20 * i + 12))
        proposer.finished(done)
        assert sum(t.num_nodes for t in proposer.shared.values()) <= 200 or len(proposer.cached) == 1
    assert 1 < len(proposer.cached) < 10
    assert list(proposer.cached)[-1] == 309  # the newest stay
