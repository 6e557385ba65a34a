"""Suffix decoding (Oliaro et al., "SuffixDecoding", NeurIPS 2025; ArcticInference's, vLLM's
`--speculative-config '{"method": "suffix"}'`): drafts from the request's own tokens and from earlier
requests' outputs, as far as their frequencies say the continuation is likely.

    proposer = SuffixProposer(SpeculativeConfig.parse('{"method": "suffix"}'))
    drafts = proposer.propose(seq, limit)   # each decode
    proposer.finished(seq)                  # its output joins the trees later requests draft from

Both sources are tries of every substring of up to `suffix_decoding_max_tree_depth` (D) tokens, each
node counting its occurrences (a suffix tree cut at depth D). A draft starts at the node of the
context's last m tokens (m < D) and follows the most frequent child while the product of each
step's frequency (the child's count over its siblings') stays >= `suffix_decoding_min_token_prob`, for at most
min(`max_spec_factor` x m, D - m) tokens: a longer match drafts further. Of every match length in both
tries, the draft with the largest expected number of kept tokens (the sum of those products) goes.
The request's trie grows as its tokens do (O(D) per token); finished outputs go into the shared trie
of their `cache_salt` (requests with different salts never draft from each other's outputs: how
fast a request decodes would otherwise say what another tenant's outputs contain), the oldest leaving
first past `suffix_decoding_max_cached_requests`. Drafts only decide what is verified: the output is
the model's own either way (engine/speculative.py). This file imports no torch.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

INDEX_PER_STEP = 256  # tokens a sequence's trie grows by in one proposal at most


class SuffixTrie:
    """Every substring of at most `depth` tokens of the sequences added, with its count. Nodes are
    ints (0: the root): `edges[node]` maps a token to the child, `count[node]` is how often its
    substring occurred. Dicts of ints and an array rather than an object per node, so that Python's
    garbage collector has next to nothing to walk however large the tries grow (with an object per
    node, one full collection over the tries of four stdlib prompts took 145 ms)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.edges: dict[int, dict[int, int]] = {0: {}}
        self.count = array("q", [0])
        self._free: list[int] = []

    def _child(self, node: int, token: int) -> int:
        children = self.edges[node]
        child = children.get(token)
        if child is None:
            if self._free:
                child = self._free.pop()
            else:
                child = len(self.count)
                self.count.append(0)
            self.edges[child] = {}
            children[token] = child
        return child

    def add(self, tokens, active: list[int] | None = None) -> list[int]:
        """Count the substrings that end at each of `tokens`; `active`: the nodes of the (< depth)
        substrings ending just before them (a sequence added in pieces). Returns those nodes after
        the last token, shortest first (node i holds the last i + 1 tokens)."""
        active = active or []
        count = self.count
        for token in tokens:
            grown = []
            for node in (0, *active):
                child = self._child(node, token)
                count[child] += 1
                grown.append(child)
            active = grown[: self.depth - 1]
        return active

    def remove(self, tokens) -> None:
        """Uncount a sequence `add` counted (in one piece): nodes that reach 0 go."""
        active: list[int] = []
        gone = []
        for token in tokens:
            grown = []
            for node in (0, *active):
                child = self.edges[node][token]
                self.count[child] -= 1
                if self.count[child] == 0:  # its descendants reach 0 in this walk too
                    del self.edges[node][token]
                    gone.append(child)
                grown.append(child)
            active = grown[: self.depth - 1]
        for node in gone:
            del self.edges[node]
            self._free.append(node)

    def matches(self, context) -> list[int]:
        """The nodes of the context's last 1, 2, ... tokens, as far as the trie has them (a longer
        suffix is in it only if the shorter ones are)."""
        found = []
        for m in range(1, min(self.depth - 1, len(context)) + 1):
            node = 0
            for token in context[len(context) - m :]:
                node = self.edges[node].get(token)
                if node is None:
                    return found
            found.append(node)
        return found

    def draft(self, node: int, room: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent path below `node`, while its estimated probability holds; (tokens, the
        expected number of them kept)."""
        tokens, expected, probability = [], 0.0, 1.0
        count = self.count
        while len(tokens) < room and (children := self.edges[node]):
            token, child = max(children.items(), key=lambda item: count[item[1]])
            # of the occurrences that went on (the sequence's own last tokens have not yet)
            probability *= count[child] / sum(count[c] for c in children.values())
            if probability < min_prob:
                break
            tokens.append(token)
            expected += probability
            node = child
        return tokens, expected


@dataclass
class _RequestTrie:
    """A sequence's own trie, grown to `added` tokens; `active`: its nodes of the last tokens."""

    trie: SuffixTrie
    added: int = 0
    active: list[int] = field(default_factory=list)


class SuffixProposer:
    def __init__(self, config):
        self.config = config
        self.depth = config.suffix_decoding_max_tree_depth
        self.shared: dict[str | None, SuffixTrie] = {}  # finished outputs, by cache_salt
        self.cached: OrderedDict[int, tuple[str | None, list[int]]] = OrderedDict()

    def propose(self, seq, limit: int) -> list[int]:
        limit = min(limit, self.config.num_speculative_tokens)
        if limit <= 0:
            return []
        tokens = seq.token_ids
        own = seq.speculation
        if own is None:
            own = seq.speculation = _RequestTrie(SuffixTrie(self.depth))
        # a long prompt is indexed over several steps (~12 us a token here), not in one pause of
        # the engine thread; until it is, its last tokens are looked up by walking
        upto = min(len(tokens), own.added + INDEX_PER_STEP)
        own.active = own.trie.add(tokens[own.added : upto], own.active)
        own.added = upto
        # the sequence's own last tokens match themselves, with no continuation yet: what follows
        # them comes from earlier occurrences
        nodes = own.active if upto == len(tokens) else own.trie.matches(tokens)
        candidates = [(own.trie, nodes)]
        shared = self.shared.get(seq.params.cache_salt)
        if shared is not None:
            candidates.append((shared, shared.matches(tokens)))
        best, best_expected = [], 0.0
        factor = self.config.suffix_decoding_max_spec_factor
        min_prob = self.config.suffix_decoding_min_token_prob
        for trie, nodes in candidates:
            for m, node in enumerate(nodes, start=1):
                room = min(limit, int(factor * m), self.depth - m)
                draft, expected = trie.draft(node, room, min_prob)
                if expected > best_expected:
                    best, best_expected = draft, expected
        return best

    def finished(self, seq) -> None:
        """`seq` ended: its output joins its salt's shared trie (the oldest cached output leaves
        past the limit)."""
        seq.speculation = None
        limit = self.config.suffix_decoding_max_cached_requests
        if limit == 0 or not seq.output_ids or not seq.may_speculate:
            return
        salt = seq.params.cache_salt
        output = list(seq.output_ids)
        self.shared.setdefault(salt, SuffixTrie(self.depth)).add(output)
        self.cached[seq.seq_id] = (salt, output)
        while len(self.cached) > limit:
            _, (old_salt, old) = self.cached.popitem(last=False)
            trie = self.shared[old_salt]
            trie.remove(old)
            if not trie.edges[0]:
                del self.shared[old_salt]
