"""Requests as the scheduler sees them: sampling parameters and one `Sequence` per sample.

A sequence is a list of token ids plus a count of how many of them already have K/V in the paged
cache (`num_computed`). Prefill, chunked prefill, decode and recompute after preemption are all the
same thing: compute `tokens[num_computed:]` (or a chunk of them); when the cache has caught up with the
tokens, the logits of the last position give the next token. This file imports no torch: the serving
simulator drives the same scheduler with a cost model.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.structured import StructuredOutputsParams

# Below this temperature a request is greedy: dividing logits by 1e-40 gives inf and a NaN softmax.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # top logprobs per position, as OpenAI's API allows


@dataclass(frozen=True)
class SamplingParams:
    """What the OpenAI API lets a client choose about sampling (temperature 0 = greedy).

    `logprobs`: return the chosen token's logprob and the top-k (0: the chosen one only; None: none);
    `prompt_logprobs`: the same for every prompt token (echo); `logit_bias`: (token id, bias) pairs."""

    max_tokens: int | None = 16  # None (vLLM's): what the context leaves; `LLM` resolves it per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one's (0 keeps every token)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # drawing one ends the sample (finish "stop"), even with ignore_eos
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text
    skip_special_tokens: bool = True  # the text leaves out special tokens (vLLM's default)
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    cache_salt: str | None = None  # starts the prefix cache's hash chain (kv_blocks.root_hash)
    priority: int = 0  # --scheduling-policy priority: lower is served first (vLLM's)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output keeps to
    # the grammar holds the reply from the end of its thinking (`</think>`), as vLLM's structured
    # outputs with a reasoning parser (`shiftlm serve --reasoning-parser` sets it)
    structured_after_thinking: bool = False

    def validate(self) -> None:
        finite = all(
            math.isfinite(v)
            for v in (self.temperature, self.top_p, self.min_p, self.presence_penalty, self.frequency_penalty)
        )
        logprobs = [k for k in (self.logprobs, self.prompt_logprobs) if k is not None]
        if not isinstance(self.max_tokens, int):  # None reaches here only outside `LLM`, which resolves it
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        checks = [
            (finite, "temperature", "sampling parameters must be finite numbers"),
            (self.max_tokens >= 1, "max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0.0 <= self.temperature <= 2.0, "temperature", "temperature must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be >= 0 (0 or -1 disables it)"),
            (1 <= self.n <= 16, "n", f"n must be in [1, 16], got {self.n}"),
            (
                isinstance(self.priority, int) and abs(self.priority) < 2**63,
                "priority",
                "priority must be an integer",
            ),
            (len(self.stop) <= 4 and all(self.stop), "stop", "stop takes up to 4 non-empty strings"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                "frequency_penalty must be in [-2, 2]",
            ),
            (
                0.0 < self.repetition_penalty <= 10.0,
                "repetition_penalty",
                "repetition_penalty must be in (0, 10] (1 disables it)",
            ),
            (
                all(-100.0 <= bias <= 100.0 for _, bias in self.logit_bias),
                "logit_bias",
                "logit_bias values must be in [-100, 100]",
            ),
            (
                all(0 <= k <= MAX_LOGPROBS for k in logprobs),
                "logprobs",
                f"logprobs must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                0 <= self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens must be in [0, max_tokens = {self.max_tokens}]",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def reads_own_tokens(self) -> bool:
        """Drawing the next token reads the tokens drawn so far (penalties, min_tokens): a draw ahead
        of the previous token's read takes that token from the device (`SampleRow.pending`)."""
        return (
            self.min_tokens > 0
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def argmax_only(self) -> bool:
        """The next token is the raw logits' argmax and nothing else of them is returned or used (no
        logprobs, bias, penalties, min_tokens or grammar): a 2-rank step sends (max, argmax) per rank, not logits."""
        return (
            self.greedy
            and self.n == 1
            and self.logprobs is None
            and self.prompt_logprobs is None
            and not self.logit_bias
            and self.min_tokens == 0
            and self.structured_outputs is None
            and self.repetition_penalty == 1.0
            and self.frequency_penalty == 0.0
            and self.presence_penalty == 0.0
        )


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # the client went away


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_sequence_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One sample of one request; `block_ids` is its block table (logical block i -> physical id)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading full blocks already offered to the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # kv_blocks.block_hash of each
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    row: int = -1  # the scheduler's batch row while running (the runner's block-table row), else -1
    num_blocks_sent: int = 0  # leading entries of block_ids the runner already has in its table
    # tokens drawn by a step still running (asynchronous scheduling): counted in `num_tokens`, not yet
    # in `output_ids`; the next chunk carries them as `plan.PENDING`
    num_pending: int = 0
    # speculative decoding (engine/speculative.py): the tokens drafted to follow `token_ids`, verified
    # by the step running now (not counted in `num_tokens`), and the proposer's own state
    draft_ids: list[int] = field(default_factory=list)
    speculation: object = None
    _all_ids: list[int] = field(default_factory=list, init=False, repr=False)

    @property
    def token_ids(self) -> list[int]:
        """prompt + output (the tokens known on the host; `num_pending` more are in flight) as one list, extended in place as outputs are appended: O(new tokens) per
        call, never a copy of the context (read-only for callers)."""
        missing = len(self.prompt_ids) + len(self.output_ids) - len(self._all_ids)
        if missing > 0:
            if len(self._all_ids) < len(self.prompt_ids):
                self._all_ids[:] = self.prompt_ids
                missing = len(self.output_ids)
            self._all_ids.extend(self.output_ids[len(self.output_ids) - missing :])
        return self._all_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    def last_pending_token(self, max_model_len: int) -> bool:
        """The token in flight is its last by length (max_tokens or the context): nothing to schedule."""
        return self.num_pending > 0 and (
            len(self.output_ids) + self.num_pending >= self.params.max_tokens
            or self.num_tokens >= max_model_len
        )

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    # Hooks a stream group (serve/engine/streams.py) overrides; an ordinary sequence is one causal stream.
    def chunk_len(self, budget: int) -> int:
        """Tokens to compute next within `budget` (0: wait for a larger budget)."""
        return min(self.num_uncomputed, budget)

    @property
    def num_sampled_rows(self) -> int:
        """Logits rows wanted at the end of the tokens: the last one."""
        return 1

    @property
    def may_speculate(self) -> bool:
        """Its next tokens may be drafted and verified in one step (one causal stream)."""
        return True

    @property
    def context_len(self) -> int:
        """The longest context one of its tokens reads (bounded by max_model_len)."""
        return self.num_tokens

    @property
    def num_cacheable(self) -> int:
        """Leading tokens whose K/V depend on the tokens alone (may go to the prefix cache)."""
        return self.num_tokens

    def chunk_tags(self, start: int, end: int) -> dict:
        """Extra `ScheduledChunk` fields for tokens [start, end) (a stream group's layout and tags)."""
        return {}

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
