"""Vocab-parallel cross-entropy (Megatron-LM `cross_entropy.py`), and the LM head fused with it.

Logits stay split over the vocabulary: three all-reduces in forward (max, target logit, sum of
exponentials), none in backward, whose gradient softmax - onehot is local to each shard. The maths is
in plain functions so it can be checked without communication.

`chunked_head_cross_entropy` never holds the logits of the whole batch: it runs the LM head and the
loss `rows` tokens at a time, keeps per token only its log-sum-exp, and in backward recomputes each
chunk's logits to form softmax - onehot and the two GEMMs of the head's gradient (the approach of
Liger-Kernel's fused linear cross-entropy and of Wijmans et al. 2024, "Cut Your Losses"). At a
32000-token vocabulary in fp32 the whole-batch logits, their softmax and their gradient are
12 x 32000 x 4 = 384 KiB per token (3 MiB per 8 tokens); a chunk of 1024 rows caps them at 375 MiB.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shiftlm.comm import CommGroup, all_reduce

IGNORE_INDEX = -100


def _target_in_shard(
    targets: torch.Tensor, vocab_start: int, vocab_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    local = targets - vocab_start
    outside = (local < 0) | (local >= vocab_local)
    return local.masked_fill(outside, 0), outside


def _cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: CommGroup, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss of fp32 vocab-parallel logits (0 where ignored), the softmax (in the logits'
    storage: they are overwritten) and each token's log-sum-exp over the whole vocabulary."""
    logits_max = all_reduce(logits.max(dim=-1)[0], group, op=dist.ReduceOp.MAX)
    shifted = logits.sub_(logits_max.unsqueeze(-1))
    local, outside = _target_in_shard(targets, vocab_start, logits.shape[-1])
    target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    target_logit = all_reduce(target_logit, group)
    exp = shifted.exp_()
    sum_exp = all_reduce(exp.sum(dim=-1), group)
    log_sum_exp = torch.log(sum_exp)
    loss = (log_sum_exp - target_logit).masked_fill(targets == IGNORE_INDEX, 0.0)
    return loss, exp.div_(sum_exp.unsqueeze(-1)), log_sum_exp + logits_max


def _softmax_grad_(
    softmax: torch.Tensor, targets: torch.Tensor, grad_loss: torch.Tensor, vocab_start: int
) -> torch.Tensor:
    """d loss / d logits = (softmax - onehot(target)) * grad_loss, 0 for ignored tokens; in place."""
    local, outside = _target_in_shard(targets, vocab_start, softmax.shape[-1])
    softmax.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(softmax.dtype).unsqueeze(-1))
    return softmax.mul_((grad_loss * (targets != IGNORE_INDEX)).unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start):
        loss, softmax, _ = _cross_entropy(logits.to(torch.float32, copy=True), targets, group, vocab_start)
        ctx.vocab_start = vocab_start
        ctx.save_for_backward(softmax, targets)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, targets = ctx.saved_tensors
        # a copy: the graph may be walked twice (input and weight gradients apart)
        return _softmax_grad_(softmax.clone(), targets, grad_loss, ctx.vocab_start), None, None, None


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None, padding: torch.Tensor | None
) -> torch.Tensor:
    """fp32 logits of one chunk: the GEMM in `dtype` (autocast's, or the operands' own), padding
    columns -inf."""
    if dtype is not None:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    logits = (hidden @ weight.t()).float()
    return logits if padding is None else logits.masked_fill_(padding, float("-inf"))


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_start, padding, rows):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        losses, log_sum_exps = [], []
        with torch.autocast(device, enabled=False):
            for start in range(0, flat.shape[0], rows):
                logits = _chunk_logits(flat[start : start + rows], weight, dtype, padding)
                loss, _, log_sum_exp = _cross_entropy(
                    logits, flat_targets[start : start + rows], group, vocab_start
                )
                losses.append(loss)
                log_sum_exps.append(log_sum_exp)
        ctx.dtype, ctx.group, ctx.vocab_start, ctx.rows = dtype, group, vocab_start, rows
        ctx.save_for_backward(hidden, weight, targets, padding, torch.cat(log_sum_exps))
        return torch.cat(losses).view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, padding, log_sum_exp = ctx.saved_tensors
        flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        grad_loss = grad_loss.reshape(-1)
        grad_hidden = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        dtype = ctx.dtype or flat.dtype
        for start in range(0, flat.shape[0], ctx.rows):
            chunk = slice(start, start + ctx.rows)
            # the softmax from the saved log-sum-exp: no collective in backward
            softmax = _chunk_logits(flat[chunk], weight, ctx.dtype, padding)
            softmax = softmax.sub_(log_sum_exp[chunk].unsqueeze(-1)).exp_()
            grad_logits = _softmax_grad_(softmax, flat_targets[chunk], grad_loss[chunk], ctx.vocab_start)
            grad_logits = grad_logits.to(dtype)
            if grad_hidden is not None:
                grad_hidden[chunk] = grad_logits @ weight.to(dtype)
            if grad_weight is not None:
                grad_weight.add_(grad_logits.t() @ flat[chunk].to(dtype))
        grad_hidden = None if grad_hidden is None else grad_hidden.view(hidden.shape)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: CommGroup, vocab_start: int
) -> torch.Tensor:
    """Per-token loss from logits split over the vocabulary; targets == -100 give 0 loss and 0 gradient.

    Padded vocabulary columns must already be -inf in `logits`.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start)


def chunked_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    group: CommGroup,
    vocab_start: int,
    padding: torch.Tensor | None,
    rows: int,
) -> torch.Tensor:
    """Per-token loss of the LM head `weight` (this rank's vocabulary rows) applied to `hidden`
    ([..., hidden], the head's input as every TP rank sees it), `rows` tokens at a time; targets -100
    give 0 loss and 0 gradient, `padding` (bool per local vocabulary row, or None) marks rows that
    never win. Equal to `vocab_parallel_cross_entropy(hidden @ weight.T)`; autograd's input gradient
    of `hidden` is this rank's partial sum (the head's `copy_to_group` sums it over TP)."""
    return _ChunkedHeadCrossEntropy.apply(hidden, weight, targets, group, vocab_start, padding, rows)
