"""Activation recomputation (`train.recompute`), applied to a built stage from the trainer's side.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
- `full` (their Sec. 4.1 baseline): each decoder layer keeps only its input; backward reruns the
  layer's forward first. Memory per layer drops from about `sbh(34 + 5as/h)` bytes to `2sbh`
  (their Eq. 1/2), for one extra forward (~33% more FLOPs).
- `selective` (Sec. 4.2): only the attention core, softmax(QK^T / sqrt(d)) V, is recomputed; its
  `5as^2b` bytes of score and softmax activations (quadratic in s) are the part that is large and
  cheap to rebuild. A fused kernel (SDPA's flash path) already keeps none of them, so the saving is
  then the core's own outputs; on the math path (an explicit mask, e.g. a sliding window) it is the
  s x s matrices.

Both use non-reentrant `torch.utils.checkpoint` (which works under `torch.autograd.grad`, as the
pipeline executor calls it, and with the deferred weight gradients of its I/W split). The model's
code is unchanged: `full` wraps each layer's `forward`, `selective` runs each attention forward under
a torch-function mode that routes `F.scaled_dot_product_attention` through the checkpoint. Parameter
names are untouched, so checkpoints do not depend on the setting, and recomputation repeats the same
kernels on the same inputs, so losses and gradients are bit-identical to `none`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from shiftlm.model import Transformer


class _RecomputeAttentionCore(TorchFunctionMode):
    """Inside this mode, `F.scaled_dot_product_attention` keeps only its inputs for backward."""

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def _attention_with_core_recompute(forward: Callable, *args: Any, **kwargs: Any) -> Any:
    with _RecomputeAttentionCore():
        return forward(*args, **kwargs)


def apply_recompute(stage: Transformer, mode: str, compiled: bool = False) -> None:
    """Make `stage`'s decoder layers recompute activations in backward: none | selective | full.

    `compiled`: the layers' forwards are compiled blocks (`model/compile.py`), which this wraps. Then
    `selective` runs the whole block under the mode (it acts on SDPA alone, so the same thing), since a
    per-attention patch is a distinct object per layer and dynamo would compile every layer anew."""
    for layer in stage.model.layers.values():
        if mode == "full":
            # the recomputation gets the forward's arguments again, `ops` among them: the same linears
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
        elif mode == "selective":
            owner = layer if compiled else layer.self_attn
            owner.forward = partial(_attention_with_core_recompute, owner.forward)
