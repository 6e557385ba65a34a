"""Next-token sampling on rank 0: greedy, temperature, top-k, top-p (nucleus), per-sample seeds.

Order as in Hugging Face `generate` and vLLM: temperature scales the logits, top-k keeps the k largest,
top-p keeps the smallest set of tokens whose probability reaches p (Holtzman et al., ICLR 2020), then one
token is drawn. A seeded request owns a `torch.Generator`, so its samples do not depend on what else
is in the batch.
"""

from __future__ import annotations

import torch

from shiftlm.serve.sequence import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits of tokens outside top-k / top-p to -inf (1-D logits)."""
    if 0 < top_k < logits.numel():
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p; the top token always stays
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(
            torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf")
        )
    return logits


def make_generator(params: SamplingParams, sample_index: int) -> torch.Generator | None:
    """A private generator for seeded requests; sample i of n uses seed + i so the samples differ."""
    if params.seed is None or params.greedy:
        return None
    generator = torch.Generator()
    generator.manual_seed(params.seed + sample_index)
    return generator


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits."""
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits))
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
