"""Suffix decoding (Oliaro et al., "SuffixDecoding", NeurIPS 2025; ArcticInference's, vLLM's
`--speculative-config '{"method": "suffix"}'`): drafts from the request's own tokens and from earlier
requests' outputs, as far as their frequencies say the continuation is likely.

    proposer = SuffixProposer(SpeculativeConfig.parse('{"method": "suffix"}'))
    drafts = proposer.propose(seq, limit)   # each decode
    proposer.finished(seq)                  # its output joins the trees later requests draft from

Both sources are tries of every substring of up to `suffix_decoding_max_tree_depth` (D) tokens,
each node counting its occurrences (a suffix tree cut at depth D). A draft starts at the node of the
context's last m tokens (m < D) and follows the most frequent child while the product of each step's
frequency (the child's count over its siblings') stays >= `suffix_decoding_min_token_prob`, for at
most min(`max_spec_factor` x m, D - m) tokens: a longer match drafts further. Of every match length
in both tries, the draft with the largest expected number of kept tokens (the sum of those
products) goes. The request's trie grows as its tokens do (O(D) per token); finished outputs go
into the shared trie of their `cache_salt` (requests with different salts never draft from each
other's outputs: how fast a request decodes would otherwise say what another tenant's outputs
contain), the oldest leaving first past `suffix_decoding_max_cached_requests` or 4M nodes (~140
MB). Drafts only decide what is verified: the output is the model's own either way
(engine/speculative.py). This file imports no torch.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

INDEX_PER_STEP = 256  # tokens a sequence's trie grows by in one proposal at most
# the shared tries' size bound beside max_cached_requests (~35 bytes a node: ~140 MB): 10,000 cached
# outputs of 500 tokens that share nothing would be 120M nodes
MAX_SHARED_NODES = 4_000_000


class SuffixTrie:
    """Every substring of at most `depth` tokens of the sequences added, with its count.

    Nodes are ints (0: the root) in arrays: `count[node]`, how often its substring occurred, and its
    child when it has one (`token`, `child`; -1: none); a node with two or more children keeps them
    all in `branches[node]` (token -> child) instead. Most nodes of a text's trie have one child (a
    substring that occurred once goes on one way), so a node costs ~35 bytes, not the ~300 of a dict
    each, and ints in arrays give Python's garbage collector nothing to walk (a full collection takes
    as long with them as without: bench/serve_host_overhead.py)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.count = array("q", [0])
        self.token = array("q", [-1])
        self.child = array("q", [-1])
        self.branches: dict[int, dict[int, int]] = {}
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def children(self, node: int):
        """(token, child) pairs of `node`."""
        branches = self.branches.get(node)
        if branches is not None:
            return branches.items()
        return () if self.token[node] < 0 else ((self.token[node], self.child[node]),)

    def get(self, node: int, token: int) -> int | None:
        branches = self.branches.get(node)
        if branches is not None:
            return branches.get(token)
        return self.child[node] if self.token[node] == token else None

    def _new(self, node: int, token: int) -> int:
        """A fresh child of `node` for `token` (count 0)."""
        if self._free:
            child = self._free.pop()
            self.count[child], self.token[child], self.child[child] = 0, -1, -1
        else:
            child = len(self.count)
            self.count.append(0)
            self.token.append(-1)
            self.child.append(-1)
        branches = self.branches.get(node)
        if branches is not None:
            branches[token] = child
        elif self.token[node] < 0:
            self.token[node], self.child[node] = token, child
        else:  # a second child: every child goes to a dict
            self.branches[node] = {self.token[node]: self.child[node], token: child}
        return child

    def _unlink(self, node: int, token: int) -> None:
        branches = self.branches.get(node)
        if branches is None:
            self.token[node] = -1
            return
        del branches[token]
        if len(branches) == 1:  # back to one child
            ((self.token[node], self.child[node]),) = branches.items()
            del self.branches[node]

    def add(self, tokens, active: list[int] | None = None) -> list[int]:
        """Count the substrings that end at each of `tokens`; `active`: the nodes of the (< depth)
        substrings ending just before them (a sequence added in pieces). Returns those nodes after
        the last token, shortest first (node i holds the last i + 1 tokens)."""
        active = active or []
        count = self.count
        for token in tokens:
            grown = []
            for node in (0, *active):
                child = self.get(node, token)
                if child is None:
                    child = self._new(node, token)
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
                child = self.get(node, token)
                self.count[child] -= 1
                if self.count[child] == 0:  # its descendants reach 0 in this walk too
                    self._unlink(node, token)
                    gone.append(child)
                grown.append(child)
            active = grown[: self.depth - 1]
        for node in gone:
            self.branches.pop(node, None)
            self._free.append(node)

    def matches(self, context) -> list[int]:
        """The nodes of the context's last 1, 2, ... tokens, as far as the trie has them (a longer
        suffix is in it only if the shorter ones are)."""
        found = []
        for m in range(1, min(self.depth - 1, len(context)) + 1):
            node = 0
            for token in context[len(context) - m :]:
                node = self.get(node, token)
                if node is None:
                    return found
            found.append(node)
        return found

    def draft(self, node: int, room: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent path below `node`, while its estimated probability holds; (tokens, the
        expected number of them kept)."""
        tokens, expected, probability = [], 0.0, 1.0
        count = self.count
        while len(tokens) < room:
            children = self.children(node)
            if not children:
                break
            token, child = max(children, key=lambda item: count[item[1]])
            # of the occurrences that went on (the sequence's own last tokens have not yet)
            probability *= count[child] / sum(count[c] for _, c in children)
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
        # a long prompt is indexed over several steps (~26 us a token here, bench/serve_host_overhead.py),
        # not in one pause of the engine thread; until it is, its last tokens are looked up by walking
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
        """`seq` ended: its output joins its salt's shared trie (the oldest cached outputs leave past
        max_cached_requests or `MAX_SHARED_NODES`)."""
        seq.speculation = None
        limit = self.config.suffix_decoding_max_cached_requests
        if limit == 0 or not seq.output_ids or not seq.may_speculate:
            return
        salt = seq.params.cache_salt
        output = list(seq.output_ids)
        self.shared.setdefault(salt, SuffixTrie(self.depth)).add(output)
        self.cached[seq.seq_id] = (salt, output)
        while len(self.cached) > limit or (
            len(self.cached) > 1 and sum(t.num_nodes for t in self.shared.values()) > MAX_SHARED_NODES
        ):
            _, (old_salt, old) = self.cached.popitem(last=False)
            trie = self.shared[old_salt]
            trie.remove(old)
            if trie.num_nodes == 1:  # the root alone
                del self.shared[old_salt]
