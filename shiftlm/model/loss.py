"""Vocab-parallel cross-entropy (Megatron-LM `cross_entropy.py`).

Logits stay split over the vocabulary: three all-reduces in forward (max, target logit, sum of
exponentials), none in backward, whose gradient softmax - onehot is local to each shard. The maths is
in plain functions so it can be checked without communication.
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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start):
        logits = logits.float()
        logits_max = all_reduce(logits.max(dim=-1)[0], group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        local, outside = _target_in_shard(targets, vocab_start, logits.shape[-1])
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = all_reduce(target_logit, group)
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group)
        loss = torch.log(sum_exp) - target_logit
        ignored = targets == IGNORE_INDEX
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()  # the graph may be walked twice (input and weight gradients apart)
        hit = (~outside).float()
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: CommGroup, vocab_start: int
) -> torch.Tensor:
    """Per-token loss from logits split over the vocabulary; targets == -100 give 0 loss and 0 gradient.

    Padded vocabulary columns must already be -inf in `logits`.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start)
