"""Speculative decoding without a draft model (vLLM's `--speculative-config`): its config, and the
n-gram drafter (prompt lookup decoding, Saxena 2023: the tokens that followed the latest earlier
occurrence of a sequence's last n tokens); the suffix drafter is engine/suffix_tree.py.

    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    drafts = make_proposer(config).propose(seq, limit)   # up to `limit` token ids, maybe none

A decode chunk then carries [last token, d1 .. dk] and its k + 1 rows are all sampled, row j with
d1 .. dj as its history (`requests.SingleRequest`). Draft j + 1 is kept while the token drawn at row j
equals it; the first draw that differs (or the draw after the last draft) is kept too and ends the
step. For a proposal that is one token (not a distribution), this is exact speculative sampling
(Leviathan et al., ICML 2023; Chen et al. 2023): a draft d is kept with probability p(d), and
otherwise the token drawn is distributed as p with d removed, renormalized, which is what rejection
sampling against a one-hot proposal gives. So every kept token is drawn from the model's own
distribution, greedy output is unchanged, and a seeded sample draws the same tokens with or without
speculation (its generator is rewound to the last kept draw). This file imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from shiftlm.errors import ConfigError

METHODS = ("ngram", "suffix")
_KEYS = {
    "ngram": ("prompt_lookup_max", "prompt_lookup_min"),
    "suffix": (
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    ),
}
_FLAG = "--speculative-config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """`num_speculative_tokens` drafted per step at most. `ngram`: the draft follows the longest
    n-gram of `prompt_lookup_max` down to `prompt_lookup_min` tokens that ends the sequence and
    occurred before. `suffix` (engine/suffix_tree.py): vLLM's suffix_decoding_* options."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    method: str = "ngram"
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # no drafts in a step while more sequences than this run (vLLM's key; vLLM decides it per new
    # request, shiftlm per step): at high load a step is compute-bound and verifying costs
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, text: str | dict) -> SpeculativeConfig:
        """vLLM's `--speculative-config` JSON (or its dict, as `LLM(speculative_config=...)` takes);
        ConfigError naming the key and the fix."""
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{_FLAG} is not JSON ({err.msg}); e.g. "
                    '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\''
                ) from None
        if not isinstance(text, dict):
            raise ConfigError(f"{_FLAG} must be a JSON object, got {type(text).__name__}")
        method = {"[ngram]": "ngram"}.get(text.get("method", "ngram"), text.get("method", "ngram"))
        if method not in METHODS:
            raise ConfigError(
                f"{_FLAG}: method {method!r} is not supported; this server speculates with: {', '.join(METHODS)}"
            )
        allowed = ("method", "num_speculative_tokens", "disable_by_batch_size", *_KEYS[method])
        unknown = sorted(set(text) - set(allowed))
        if unknown:
            raise ConfigError(
                f"{_FLAG}: unknown key(s) {', '.join(unknown)} for method {method}; it takes {', '.join(allowed)}"
            )
        config = cls._ngram(text) if method == "ngram" else cls._suffix(text)
        limit = text.get("disable_by_batch_size")
        if limit is not None:
            _check_int("disable_by_batch_size", limit, 1, 1 << 20)
        return replace(config, disable_by_batch_size=limit)

    @classmethod
    def _ngram(cls, text: dict) -> SpeculativeConfig:
        if "num_speculative_tokens" not in text:
            raise ConfigError(f"{_FLAG} needs num_speculative_tokens (the most tokens drafted per step)")
        lookup_max, lookup_min = text.get("prompt_lookup_max"), text.get("prompt_lookup_min")
        # vLLM's defaults: 5 and 5, or the one given for both
        lookup_max = lookup_max if lookup_max is not None else (lookup_min if lookup_min is not None else 5)
        lookup_min = lookup_min if lookup_min is not None else lookup_max
        values = {
            "num_speculative_tokens": text["num_speculative_tokens"],
            "prompt_lookup_max": lookup_max,
            "prompt_lookup_min": lookup_min,
        }
        for key, value in values.items():
            _check_int(key, value, 1, 64)
        if lookup_min > lookup_max:
            raise ConfigError(
                f"{_FLAG}: prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max ({lookup_max})"
            )
        return cls(method="ngram", **values)

    @classmethod
    def _suffix(cls, text: dict) -> SpeculativeConfig:
        depth = text.get("suffix_decoding_max_tree_depth", 24)
        # a request's trie holds up to D nodes a token (~35 bytes each): 64 keeps a 4k context under 10 MB
        _check_int("suffix_decoding_max_tree_depth", depth, 2, 64)
        # vLLM's default: as many as the tree is deep
        tokens = text.get("num_speculative_tokens", depth)
        _check_int("num_speculative_tokens", tokens, 1, 64)
        cached = text.get("suffix_decoding_max_cached_requests", 10000)
        _check_int("suffix_decoding_max_cached_requests", cached, 0, 10**7)
        factor = text.get("suffix_decoding_max_spec_factor", 1.0)
        probability = text.get("suffix_decoding_min_token_prob", 0.1)
        for key, value, low, high in (
            ("suffix_decoding_max_spec_factor", factor, 0.0, 64.0),
            ("suffix_decoding_min_token_prob", probability, 0.0, 1.0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ConfigError(f"{_FLAG}: {key} must be a number in [{low:g}, {high:g}], got {value!r}")
        return cls(
            num_speculative_tokens=tokens,
            method="suffix",
            suffix_decoding_max_tree_depth=depth,
            suffix_decoding_max_cached_requests=cached,
            suffix_decoding_max_spec_factor=float(factor),
            suffix_decoding_min_token_prob=float(probability),
        )

    def describe(self) -> str:
        if self.method == "suffix":
            return (
                f"suffix decoding: up to {self.num_speculative_tokens} draft tokens per step, trees "
                f"{self.suffix_decoding_max_tree_depth} deep, {self.suffix_decoding_max_cached_requests} "
                "finished requests cached"
            )
        return (
            f"ngram speculation: up to {self.num_speculative_tokens} draft tokens per step, "
            f"n-grams of {self.prompt_lookup_min}-{self.prompt_lookup_max} tokens"
        )


def _check_int(key: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{_FLAG}: {key} must be an integer in [{low}, {high}], got {value!r}")


def make_proposer(config: SpeculativeConfig):
    """The drafter of `config.method`: `propose(seq, limit)` per decode, `finished(seq)` when a
    sequence ends."""
    if config.method == "suffix":
        from shiftlm.serve.engine.suffix_tree import SuffixProposer

        return SuffixProposer(config)
    return NgramProposer(config)


@dataclass
class _Index:
    """Per sequence and n: the end of each n-gram's latest occurrence, for n-grams ending before
    `indexed` (a token list only grows, so each step adds only the new ends)."""

    latest: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    indexed: int = 0


class NgramProposer:
    """Drafts from the sequence's own tokens (prompt and output); its index lives on the sequence
    (`Sequence.speculation`), so it goes when the sequence does."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)

    def propose(self, seq, limit: int) -> list[int]:
        """Up to min(limit, num_speculative_tokens) draft tokens to follow `seq.token_ids`."""
        limit = min(limit, self.config.num_speculative_tokens)
        tokens = seq.token_ids
        length = len(tokens)
        if limit <= 0 or length <= self.config.prompt_lookup_min:
            return []
        index = seq.speculation
        if index is None:
            index = seq.speculation = _Index({n: {} for n in self.sizes})
        # index the n-grams ending at positions up to length - 1: an occurrence must be followed by a
        # token, and the sequence's own last n tokens are the query, not a match
        for end in range(max(index.indexed, 1), length):
            for n, latest in index.latest.items():
                if end >= n:
                    latest[tuple(tokens[end - n : end])] = end
        index.indexed = length
        for n in self.sizes:
            if n >= length:
                continue
            end = index.latest[n].get(tuple(tokens[length - n :]))
            if end is not None:
                # what followed, continued past the end as the repeat it implies (a loop of period
                # length - end drafts `limit` tokens, not only the period's)
                draft: list[int] = []
                for j in range(end, end + limit):
                    draft.append(tokens[j] if j < length else draft[j - length])
                return draft
        return []

    def finished(self, seq) -> None:
        """Nothing outlives a sequence here (its index goes with it)."""
