"""Make every shard's gradient the full-model gradient of the rows it holds.

Within a TP group two kinds of parameter are held by more than one rank and see only part of the
gradient: norm weights under Megatron sequence parallelism (each rank normalises its own tokens;
Korthikanti et al. 2022 sec. 4.2.2 all-reduce them), and KV-head rows replicated because there are
fewer KV heads than TP ranks (each replica serves only its own query heads), and the MoE router and per-head q/k norms, whose
gradient each TP rank holds a part of (`sharding.tp_partial_grad`). Call
`sync_tp_replicated_grads` after backward and before the data-parallel gradient sync. Gradients of
Ulysses SP ranks (which see different tokens) are summed by the dp_sp gradient sync, not here.
"""

from __future__ import annotations

import torch

from shiftlm.comm import all_gather, all_reduce
from shiftlm.model.sharding import shard_spec, tp_partial_grad
from shiftlm.model.transformer import Transformer


@torch.no_grad()
def sync_tp_replicated_grads(model: Transformer) -> None:
    tp = model.mesh.tp
    if tp.size == 1:
        return
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        spec = shard_spec(name, model.config, tp.rank, tp.size)
        if spec.dim is None:
            if model.sequence_parallel or tp_partial_grad(name):
                param.grad.copy_(all_reduce(param.grad, tp))
            continue
        replicas = [r for r in range(tp.size) if shard_spec(name, model.config, r, tp.size) == spec]
        if len(replicas) > 1:
            shards = all_gather(param.grad.unsqueeze(0), tp, dim=0)
            param.grad.copy_(shards[replicas].sum(dim=0))
