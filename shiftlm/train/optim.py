"""The optimiser's arithmetic: warmup + cosine learning rate and the AdamW update on flat tensors.

Kept free of communication so that every layout runs the same element-wise maths on its own slice
of the parameters (ZeRO-1 shards, TP shards): the update of an element never depends on the layout.
"""

from __future__ import annotations

import math

import torch

from shiftlm.train.config import OptimSection


def learning_rate(step: int, total_steps: int, optim: OptimSection) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `total_steps`
    (Loshchilov & Hutter 2017, SGDR §3, without restarts). `step` counts from 0."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    decay_mask: torch.Tensor,
    step: int,
    lr: float,
    optim: OptimSection,
) -> None:
    """One AdamW step in place (Loshchilov & Hutter 2019, Algorithm 2): Adam moments with bias
    correction, and weight decay decoupled from the gradient, applied only where `decay_mask` is 1.
    `step` counts from 1."""
    exp_avg.lerp_(grad, 1.0 - optim.beta1)
    exp_avg_sq.mul_(optim.beta2).addcmul_(grad, grad, value=1.0 - optim.beta2)
    bias1 = 1.0 - optim.beta1**step
    bias2 = 1.0 - optim.beta2**step
    denominator = (exp_avg_sq / bias2).sqrt_().add_(optim.eps)
    param.mul_(1.0 - lr * optim.weight_decay * decay_mask)
    param.addcdiv_(exp_avg, denominator, value=-lr / bias1)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor gradients are scaled by so that their global norm is at most `max_norm` (0: off)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
