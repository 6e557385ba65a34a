"""Next-token sampling on rank 0, one call per step over all sampled rows: penalties, logit bias,
temperature, top-k, top-p, per-sample seeds, and the logprobs the OpenAI API returns.

    result = sample_rows(logits, [SampleRow(row, params, generator, prompt_ids, output_ids), ...], eos_ids)
    result.tokens[i], result.logprobs[i]          # one entry per SampleRow, in order

Order as in vLLM: the grammar's mask (structured outputs), logit_bias, min_tokens (EOS and
stop_token_ids masked), repetition penalty (CTRL, Keskar et al. 2019: divide a seen token's
positive logit, multiply a negative one), frequency and presence penalties
(OpenAI: logit - frequency * count - presence * [count > 0], over generated tokens), then temperature,
min-p (a token less likely than min_p times the most likely one is dropped), top-k and top-p
(nucleus; Holtzman et al., ICLR 2020), then one draw. Every step works on the whole [rows, vocab]
tensor at once, where the logits are (the GPU). The draw is the exponential race (as
vLLM's sampler): token = argmax(p / E) with E ~ Exp(1) per token, which picks token i with probability
p_i; a seeded row's E comes from its own CPU `torch.Generator` (so its samples do not depend on what
else is in the batch, and a seed picks the same token on every device), the others' from the device.
Logprobs are those of the model's own distribution (`log_softmax` of the raw logits), as lm-eval and
vLLM's default report them.

Everything the host needs to decide (which rows are greedy, filter, are penalized) comes from the
requests' parameters, never from the device; the step's results (tokens, chosen logprobs, top-k)
cross to the host in one copy at the end (`Draw`), started as soon as they are drawn.

Whatever a request sends, sampling cannot raise: temperatures below `GREEDY_BELOW` are greedy (dividing
by 1e-40 turns logits into inf and the softmax into NaN), seeds are reduced mod 2**63 (what
`torch.Generator.manual_seed` accepts), and a row with no finite probability falls back to its argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shiftlm.serve.engine.sequence import GREEDY_BELOW, SamplingParams

SEED_MODULUS = 2**63


@dataclass(frozen=True)
class SampleRow:
    """One token to draw: which logits row, with what parameters and history."""

    logits_row: int
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    # the token the step still running drew for this sequence ([1], on the device; asynchronous
    # scheduling): the last of its outputs, not yet in `output_ids`
    pending: torch.Tensor | None = None
    # the tokens its grammar allows (structured outputs): an int32 bitmask on the host, else None
    allowed: torch.Tensor | None = None
    # a seeded row of a speculative step: where its generator's state after this row's draw goes
    # (by `logits_row`), so that the sample can be rewound to its last kept draw
    generator_states: dict[int, torch.Tensor] | None = None

    @property
    def num_outputs(self) -> int:
        return len(self.output_ids) + (self.pending is not None)


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and the `k` most likely tokens of that position (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SampleResult:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]  # None where the request asked for no logprobs


def make_generator(params: SamplingParams, sample_index: int) -> torch.Generator | None:
    """A private generator for seeded requests; sample i of n uses seed + i so the samples differ."""
    if params.seed is None or params.greedy:
        return None
    generator = torch.Generator()
    generator.manual_seed((params.seed + sample_index) % SEED_MODULUS)
    return generator


def _on(device: torch.device, values, dtype: torch.dtype) -> torch.Tensor:
    """Host values (a list, a number, or a tensor) as a tensor on `device`, without waiting for the
    device: made on the host, then copied asynchronously. `torch.tensor(values, device=cuda)` copies
    synchronously, i.e. waits for everything queued on the stream before it, the model's step
    included, which would leave nothing for asynchronous scheduling to overlap."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype, device="cpu")
    return host.to(device=device, dtype=dtype, non_blocking=True)


def filter_logits(
    logits: torch.Tensor, top_k: int | torch.Tensor, top_p: float | torch.Tensor
) -> torch.Tensor:
    """Set the logits of tokens outside top-k / top-p to -inf; `logits` is [V] or [rows, V] and
    top_k / top_p are scalars or one value per row (top_k 0 and top_p 1 keep everything)."""
    squeeze = logits.dim() == 1
    x = logits.unsqueeze(0) if squeeze else logits
    rows, vocab = x.shape
    k = _on(x.device, top_k, torch.long).expand(rows)
    p = _on(x.device, top_p, x.dtype).expand(rows)
    k = torch.where((k <= 0) | (k > vocab), vocab, k)  # (a boolean-mask store would read the mask back)
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    drop = torch.arange(vocab, device=x.device).unsqueeze(0) >= k.unsqueeze(1)  # ranks past k
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    # drop a token when the tokens ranked above it already reach top_p; the top token always stays
    drop |= ((torch.cumsum(probs, dim=-1) - probs) >= p.unsqueeze(1)) & (p.unsqueeze(1) < 1.0)
    drop[:, 0] = False
    out = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return out.squeeze(0) if squeeze else out


def _history(sequences: list[Sequence[int]], rows: list[SampleRow], vocab: int, device) -> torch.Tensor:
    """Counts [rows, vocab] of each row's tokens (one scatter_add over a padded id tensor), its pending
    token included (added on the device: the host does not know it yet)."""
    width = max((len(s) for s in sequences), default=0)
    padded = [list(tokens) + [vocab] * (width - len(tokens)) for tokens in sequences]
    ids = _on(device, padded, torch.long).view(len(sequences), width)
    counts = torch.zeros(len(sequences), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    waiting = [i for i, row in enumerate(rows) if row.pending is not None]
    if waiting:
        tokens = torch.cat([rows[i].pending.to(device, non_blocking=True) for i in waiting])
        where = (_on(device, waiting, torch.long), tokens)
        counts.index_put_(where, torch.ones(len(waiting), device=device), accumulate=True)
    return counts[:, :vocab]


def apply_penalties(x: torch.Tensor, rows: list[SampleRow], eos_ids: set[int]) -> torch.Tensor:
    """The grammar's mask (structured outputs), logit_bias, min_tokens, repetition / frequency /
    presence penalties on logits [rows, V]."""
    vocab = x.shape[1]
    held = [i for i, row in enumerate(rows) if row.allowed is not None]
    if held:
        x = grammar_mask(x, held, [rows[i].allowed for i in held])
    # every row's logit_bias as one sparse add (ids are distinct per row: protocol.parse_logit_bias)
    biased = [(i, token, bias) for i, row in enumerate(rows) for token, bias in row.params.logit_bias]
    if biased:
        where, ids, values = zip(*biased)
        index = (_on(x.device, where, torch.long), _on(x.device, ids, torch.long))
        x.index_put_(index, _on(x.device, values, x.dtype), accumulate=True)
    for i, row in enumerate(rows):
        stops = _stop_ids(row, eos_ids)
        if row.num_outputs < row.params.min_tokens and stops:
            x[i, _on(x.device, stops, torch.long)] = float("-inf")
    repetition = _on(x.device, [row.params.repetition_penalty for row in rows], x.dtype)
    if any(row.params.repetition_penalty != 1.0 for row in rows):  # decided from the params: no sync
        seen = _history([list(r.prompt_ids) + list(r.output_ids) for r in rows], rows, vocab, x.device) > 0
        penalty = repetition.unsqueeze(1).expand_as(x)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    frequency = _on(x.device, [row.params.frequency_penalty for row in rows], x.dtype)
    presence = _on(x.device, [row.params.presence_penalty for row in rows], x.dtype)
    if any(row.params.frequency_penalty != 0 or row.params.presence_penalty != 0 for row in rows):
        counts = _history([r.output_ids for r in rows], rows, vocab, x.device)
        x = x - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(x.dtype)
    return x


@dataclass
class Draw:
    """A step's draws, still on the device: `tokens` [rows] (the next step can read them there, without
    the host) and the table of what the host needs, whose copy to the host starts at once, so that
    `result` waits for this step's draws alone and not for whatever the device runs after them."""

    tokens: torch.Tensor
    ks: list[int | None]  # logprobs asked per row (None: none)
    with_logprobs: bool  # the table has the logprob columns
    top: int  # top-k columns in the table
    table: torch.Tensor  # [rows, 1 + (1 + 2 * top)]: token, chosen logprob, top values, top ids
    copied: torch.cuda.Event | None = None  # a device table: its asynchronous copy's event

    def result(self) -> SampleResult:
        """The tokens and logprobs on the host: the step's one read."""
        if self.copied is not None:
            self.copied.synchronize()
        ids, out = [], []
        for row, k in zip(self.table.tolist(), self.ks):  # the one read
            ids.append(int(row[0]))
            if k is None or not self.with_logprobs:
                out.append(None)
                continue
            values, top_ids = row[2 : 2 + self.top], row[2 + self.top :]
            out.append(
                TokenLogprob(int(row[0]), row[1], tuple((int(t), v) for t, v in zip(top_ids[:k], values[:k])))
            )
        return SampleResult(ids, out)


def _draw(logprobs: torch.Tensor | None, tokens: torch.Tensor, ks: list[int | None]) -> Draw:
    """The step's tokens and, where asked (`ks[i]` not None), their logprob and the row's top-k, as one
    float64 table (it holds every token id exactly) on its way to the host."""
    wanted = [k for k in ks if k is not None]
    columns = [tokens.to(torch.float64).unsqueeze(1)]
    top, with_logprobs = 0, bool(wanted) and logprobs is not None
    if with_logprobs:
        top = min(max(wanted), logprobs.shape[1])
        top_values, top_ids = torch.topk(logprobs, top, dim=-1)
        chosen_lp = logprobs.gather(1, tokens.unsqueeze(1))
        columns += [chosen_lp.to(torch.float64), top_values.to(torch.float64), top_ids.to(torch.float64)]
    table = torch.cat(columns, dim=1)
    copied = None
    if table.is_cuda:  # into pinned memory, ordered after the draws and before any later step's work
        host = torch.empty(table.shape, dtype=table.dtype, device="cpu", pin_memory=True)
        host.copy_(table, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        table = host
    return Draw(tokens, ks, with_logprobs, top, table, copied)


def sample_rows(logits: torch.Tensor, rows: list[SampleRow], eos_ids: set[int] = frozenset()) -> SampleResult:
    """Draw one token for each of `rows` from `logits` [R, V] (rows may share a logits row); one
    device-to-host copy in all."""
    return draw_rows(logits, rows, eos_ids).result()


def draw_rows(logits: torch.Tensor, rows: list[SampleRow], eos_ids: set[int] = frozenset()) -> Draw:
    """`sample_rows` without the read: the draws stay on the device until `Draw.result`."""
    if not rows:
        return _draw(None, torch.empty(0, dtype=torch.long, device=logits.device), [])
    device = logits.device
    index = [row.logits_row for row in rows]
    raw = logits if index == list(range(logits.shape[0])) else logits[_on(device, index, torch.long)]
    raw = raw.float()
    # the common case (no penalty, bias or min_tokens on any row) neither copies nor scans the logits
    x = apply_penalties(raw.clone(), rows, eos_ids) if any(_penalized(r, eos_ids) for r in rows) else raw
    tokens = torch.argmax(x, dim=-1)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]  # known on the host: no sync
    if drawn:
        take = _on(device, drawn, torch.long)
        temperature = _on(
            device, [max(rows[i].params.temperature, GREEDY_BELOW) for i in drawn], torch.float32
        )
        scaled = x[take] / temperature.unsqueeze(1)
        floors = [j for j, i in enumerate(drawn) if rows[i].params.min_p > 0]
        if floors:  # min_p (vLLM's order: before top-k/top-p, which then see what it left)
            which = _on(device, floors, torch.long)
            min_p = _on(device, [rows[drawn[j]].params.min_p for j in floors], scaled.dtype)
            part = scaled[which]
            probs = torch.softmax(part, dim=-1)
            low = probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            scaled[which] = part.masked_fill(low, float("-inf"))
        # top_k past the vocabulary keeps every token (as vLLM clamps it); never overflows int64
        narrow = [j for j, i in enumerate(drawn) if rows[i].params.top_k > 0 or rows[i].params.top_p < 1.0]
        if narrow:  # sorting the vocab is the costly part: only rows that filter pay it
            top_k = _on(device, [min(rows[drawn[j]].params.top_k, x.shape[1]) for j in narrow], torch.long)
            top_p = _on(device, [rows[drawn[j]].params.top_p for j in narrow], scaled.dtype)
            which = _on(device, narrow, torch.long)
            scaled[which] = filter_logits(scaled[which], top_k, top_p)
        probs = torch.softmax(scaled, dim=-1).nan_to_num(0.0)
        race = probs / _exponentials([rows[i] for i in drawn], probs)
        picked = torch.argmax(race, dim=-1)
        # a row with no finite probability (all -inf or NaN logits) keeps its argmax, decided on the device
        usable = probs.sum(dim=-1) > 0
        tokens[take] = torch.where(usable, picked, tokens[take])
    ks = [row.params.logprobs for row in rows]
    # no row asked for logprobs: no softmax over the vocabulary
    logprobs = torch.log_softmax(raw, dim=-1) if any(k is not None for k in ks) else None
    return _draw(logprobs, tokens, ks)


def _exponentials(rows: list[SampleRow], probs: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws shaped like `probs` [rows, V]: a seeded row's from its generator (on the CPU,
    in row order, copied over asynchronously), the others' on the device in one call."""
    noise = torch.empty_like(probs).exponential_()
    seeded = [j for j, row in enumerate(rows) if row.generator is not None]
    if seeded:
        draws = []
        for j in seeded:
            row = rows[j]
            draws.append(
                torch.empty(probs.shape[1], dtype=probs.dtype, device=row.generator.device).exponential_(
                    generator=row.generator
                )
            )
            if row.generator_states is not None:
                row.generator_states[row.logits_row] = row.generator.get_state()
        noise[_on(probs.device, seeded, torch.long)] = torch.stack(draws).to(probs.device, non_blocking=True)
    return noise


def _penalized(row: SampleRow, eos_ids: set[int]) -> bool:
    """Whether `apply_penalties` changes this row's logits."""
    params = row.params
    return bool(
        params.logit_bias
        or row.allowed is not None
        or (row.num_outputs < params.min_tokens and _stop_ids(row, eos_ids))
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0
        or params.presence_penalty != 0
    )


def grammar_mask(x: torch.Tensor, rows: list[int], packed: list[torch.Tensor]) -> torch.Tensor:
    """Logits `x` [rows, V] with every token outside its row's grammar at -inf (structured outputs:
    `rows` are the rows that have a grammar, `packed` their int32 bitmasks from `Matcher.allowed`).
    One host-to-device copy of the bitmasks, unpacked on the device."""
    words = _on(x.device, torch.stack(packed), torch.int32)  # [k, W]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [k, 32 W]
    vocab = x.shape[1]
    if allowed.shape[1] < vocab:  # logits padded past the tokenizer's vocabulary: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = _on(x.device, rows, torch.long)
    x[index] = x[index].masked_fill(~allowed[:, :vocab], float("-inf"))
    return x


def _stop_ids(row: SampleRow, eos_ids: set[int]) -> list[int]:
    """The tokens that would end this row's sample: min_tokens keeps them from being drawn."""
    return sorted(set(eos_ids).union(row.params.stop_token_ids))


def prompt_logprobs(logits: torch.Tensor, next_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """Logprob of each `next_ids[i]` under logits row i (the token the prompt actually has next)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = _on(logprobs.device, list(next_ids), torch.long)
    result = _draw(logprobs, chosen, [k] * len(next_ids)).result()
    return [entry for entry in result.logprobs if entry is not None]


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits (one-row `sample_rows`)."""
    return sample_rows(logits.unsqueeze(0), [SampleRow(0, params, generator)]).tokens[0]
