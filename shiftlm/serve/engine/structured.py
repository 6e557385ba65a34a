"""Structured outputs: the sampler draws only tokens that keep the output inside a grammar (a JSON
schema, any JSON object, a regex, a choice of strings, a Lark/GBNF grammar).

    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))

The grammar engine is llguidance (Microsoft's; one of vLLM's structured-output backends: Rust, no
dependencies of its own), as vLLM's `StructuredOutputsParams` and OpenAI's `response_format` ask:
`Grammars` compiles and validates a request's grammar against this model's tokenizer once (cached),
each sample gets its own matcher, and per step the matcher gives the allowed tokens as a bitmask
(32 tokens a word) that the sampler applies to the row's logits before penalties, temperature, top-k/p
(`sampling.apply_penalties`). The drawn token advances the matcher; a grammar that can take no more
tokens ends the sample with `stop` (EOS when the grammar allows one); `max_tokens` can still cut it
(`length`), as in vLLM.

A structured sample's next mask needs its previous token on the host, so a step that draws for one
is never run ahead (asynchronous scheduling waits for it: `Engine._can_run_ahead`).
"""

from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass

import torch

from shiftlm.extras import missing_extra
from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.tokenizer import opens_thinking, think_tokens

PARAM = "structured_outputs"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`): exactly one of a JSON schema
    (`json`: a dict or its JSON text), `regex`, `choice` (one of these strings), `grammar` (Lark, or
    GBNF as llama.cpp writes it) or `json_object` (any JSON object: `response_format: json_object`)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        # kept as text and a tuple: SamplingParams is frozen and hashable, and the grammar cache's key
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))

    def grammar_source(self) -> tuple[str, str]:
        """(llguidance's format name, the grammar text); InvalidRequest unless exactly one is given."""
        given = [
            (kind, value)
            for kind, value in (
                ("json_schema", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidRequest(
                "structured outputs take exactly one of json, regex, choice, grammar, json_object "
                f"(got {[kind for kind, _ in given] or 'none'})",
                PARAM,
            )
        kind, value = given[0]
        if kind == "json_object":
            return "json_schema", '{"type": "object"}'
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequest("choice is a non-empty list of non-empty strings", PARAM)
            return "choice", json.dumps(list(value))
        if kind == "json_schema":
            try:
                if not isinstance(json.loads(value), dict):
                    raise ValueError
            except ValueError:
                raise InvalidRequest("json is a JSON schema: an object, or its JSON text", PARAM) from None
        return kind, value


class Matcher:
    """One sample's place in its grammar. With `think` (the `<think>` and `</think>` token ids of a
    reasoning model) the grammar holds only the answer, as vLLM's structured outputs with a
    reasoning parser: nothing is masked while the sample thinks (`thinking`: the prompt left a
    `<think>` open), and where it may start to think, `<think>` is allowed beside the grammar's
    tokens."""

    def __init__(
        self, matcher, vocab_size: int, think: tuple[int, int] | None = None, thinking: bool = False
    ):
        self._matcher, self._words, self._think = matcher, (vocab_size + 31) // 32, think
        self.state = "answer" if think is None else ("thinking" if thinking else "may_think")

    def allowed(self) -> torch.Tensor | None:
        """The tokens the grammar allows next: an int32 bitmask [ceil(vocab / 32)] on the host, bit
        `t % 32` of word `t // 32` set for token t (None: any token, while the sample thinks)."""
        if self.state == "thinking":
            return None
        mask = torch.empty(self._words, dtype=torch.int32)
        self._matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if self.state == "may_think":
            word, bit = divmod(self._think[0], 32)
            mask[word] |= _bit(bit)
        return mask

    def draft_masks(self, drafts: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Speculative decoding: the drafts the grammar takes in a row (none while the sample may
        think) and the masks of the rows after 0, 1, ... of them; the matcher is left where it was."""
        masks = [self.allowed()]
        if self.state != "answer":
            return [], masks
        kept = drafts[: self._matcher.validate_tokens(drafts)]
        for i, token in enumerate(kept):
            self._matcher.consume_token(token)
            if self._matcher.is_stopped():  # complete: the sample ends at this token
                kept = kept[: i + 1]
                masks.append(None)
                break
            masks.append(self.allowed())
        self._matcher.rollback(len(kept))
        return kept, masks

    def accept(self, token: int) -> bool:
        """Advance by the drawn token; whether the grammar is complete (it takes no more tokens)."""
        if self.state != "answer":
            if self.state == "thinking" or token == self._think[0]:
                self.state = "answer" if token == self._think[1] else "thinking"
                return False
            self.state = "answer"  # the first token of an answer without thinking
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {self._matcher.get_error()}")
        return self._matcher.is_stopped()


def _bit(bit: int) -> torch.Tensor:
    """Bit `bit` of an int32 word (bit 31 is the sign bit)."""
    return torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)


class Grammars:
    """This engine's grammar compiler: llguidance's view of the tokenizer (built on the first
    structured request: 9 ms for the quickstart's 2,048-token BPE; llguidance documents ~1 s for
    large vocabularies) and the validated grammars (LRU-cached)."""

    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids: set[int], json_any_whitespace: bool = False
    ):
        """`json_any_whitespace`: JSON may put any whitespace between its tokens (vLLM's default);
        else exactly Python's `json.dumps` separators, ", " and ": ", and no newline or indent (a
        schema's own `x-guidance` options win)."""
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.json_any_whitespace = json_any_whitespace
        self._lock = threading.Lock()  # the HTTP side validates in a thread pool, the engine builds
        self._tokenizer = None

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                try:
                    import llguidance.hf
                except ModuleNotFoundError as err:  # an install without the serve extra
                    raise InvalidRequest(missing_extra(err) or str(err), PARAM) from None
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_token_ids)
                    )
                except (ValueError, TypeError) as err:
                    raise InvalidRequest(
                        f"structured outputs need a tokenizer llguidance can read (a fast Hugging Face "
                        f"tokenizer with a byte-level or byte-fallback decoder); this one: {err}",
                        PARAM,
                    ) from None
            return self._tokenizer

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile `spec`'s grammar against this tokenizer (once: cached); InvalidRequest names the error."""
        self._compile(spec)

    def _source(self, spec: StructuredOutputsParams) -> tuple[str, str]:
        kind, text = spec.grammar_source()
        if kind == "json_schema" and not self.json_any_whitespace:
            # free whitespace lets a model (a small one, or a code model fond of newlines) fill
            # max_tokens with it and never close the object: measured on the quickstart model,
            # 60 tokens of newlines and spaces around one key
            schema = json.loads(text)
            schema.setdefault(
                "x-guidance", {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            )
            text = json.dumps(schema, sort_keys=True)
        return kind, text

    # the compiled grammar, as a matcher at its start that never takes a token: each sample's matcher
    # is a copy of it (measured with the quickstart's 2,048-token BPE and a 40-field schema: building a
    # matcher 4 ms, copying one 0.01-0.09 ms), so the engine's thread never compiles a grammar that
    # the HTTP side has checked. Keyed by the request's spec (frozen, hashable), so neither is a
    # schema parsed again per sample
    @functools.lru_cache(maxsize=64)  # noqa: B019 - one Grammars per engine, for the engine's life
    def _compile(self, spec: StructuredOutputsParams):
        tokenizer = self._llg_tokenizer()  # first: says so in one line if llguidance is missing
        import llguidance

        kind, text = self._source(spec)
        grammar = llguidance.grammar_from(kind, text)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequest(f"the {kind} grammar does not compile: {_one_line(error)}", PARAM)
        start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if start.is_error():
            raise InvalidRequest(
                f"the {kind} grammar does not compile: {_one_line(start.get_error())}", PARAM
            )
        return start

    def matcher(self, spec: StructuredOutputsParams, after_thinking: bool = False, prompt_ids=()) -> Matcher:
        """A new sample's matcher, at the grammar's start; `after_thinking`: the grammar waits for the
        end of the sample's thinking (`Matcher`), which the prompt may have opened. Without single
        `<think>` / `</think>` tokens in the vocabulary it does not wait."""
        think = self.think_tokens() if after_thinking else None
        thinking = opens_thinking(prompt_ids, think)
        return Matcher(self._compile(spec).deep_copy(), self.vocab_size, think, thinking)

    @functools.cache  # noqa: B019 - one Grammars per engine, for the engine's life
    def think_tokens(self) -> tuple[int, int] | None:
        think = think_tokens(self.tokenizer)
        return think if think is not None and max(think) < self.vocab_size else None  # in the logits


def _one_line(error: str) -> str:
    """llguidance's message as one line: its first line and its `error:` line (the rest quotes the
    grammar with a caret under the place)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    detail = [line for line in lines[1:] if line.startswith("error:")]
    return " ".join(lines[:1] + detail[:1])
