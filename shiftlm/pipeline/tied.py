"""Tied input/output embeddings across pipeline stages: Megatron-LM's embedding group.

With `tie_word_embeddings` the LM head is the embedding matrix E. When the last stage is not the
first, it holds its own copy of E (`lm_head.weight`, loaded from the same tensor), and each copy sees
only its part of the gradient: dE = dE(embedding lookup) + dE(head). Megatron-LM
(`_allreduce_embedding_grads`, Narayanan et al. 2021) all-reduces the two parts over the "embedding
group" (first and last stage ranks), so both copies take the same optimizer step and stay equal.

Here the holders find each other with a one-int all-gather over the pp group and exchange their
gradients point to point, so no extra process group is needed and the middle ranks move no bytes.
A rank that holds both copies (V-shaped schedules put stage 0 and the last stage on pp rank 0) sums
them locally. Call it on every pp rank after the pipeline step, before `sync_tp_replicated_grads`
and the data-parallel sync (the three sums commute).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shiftlm.comm import all_gather
from shiftlm.comm.p2p import exchange
from shiftlm.mesh import Mesh
from shiftlm.model import Transformer


def tied_embedding_copies(stages: Sequence[Transformer]) -> list[torch.nn.Parameter]:
    """This rank's copies of a tied embedding: stage 0's table and a later stage's `lm_head`."""
    copies = []
    for stage in stages:
        if not stage.config.tie_word_embeddings:
            continue
        if stage.with_embedding:
            copies.append(stage.model.embed_tokens.weight)
        if hasattr(stage, "lm_head"):  # only built where the embedding is not on the same stage
            copies.append(stage.lm_head.weight)
    return copies


@torch.no_grad()
def sync_tied_embedding_grads(stages: Transformer | Sequence[Transformer], mesh: Mesh) -> None:
    """Give every copy of the tied embedding the sum of all copies' gradients (collective over pp).

    `stages`: the stages this rank holds. The sum is taken in pp-rank order on every holder, so the
    copies' gradients are bit-identical.
    """
    stages = [stages] if isinstance(stages, Transformer) else list(stages)
    if not stages or not stages[0].config.tie_word_embeddings or mesh.pp.size == 1:
        return
    copies = tied_embedding_copies(stages)
    holds = all_gather(torch.tensor([int(len(copies) > 0)], device=mesh.device), mesh.pp, dim=0)
    if not copies:
        return
    mine = copies[0].grad if copies[0].grad is not None else torch.zeros_like(copies[0])
    for copy in copies[1:]:
        if copy.grad is not None:
            mine = mine + copy.grad
    peers = [rank for rank, held in zip(mesh.pp.ranks, holds.tolist()) if held and rank != mesh.rank]
    parts = {mesh.rank: mine, **{peer: torch.empty_like(mine) for peer in peers}}
    # every holder sends to every other at once: one group, so the crossing sends cannot wait on each other
    handles = exchange([(mine, peer) for peer in peers], [(parts[peer], peer) for peer in peers], mesh.pp)
    for handle in handles:
        handle.wait()
    total = torch.stack([parts[rank] for rank in sorted(parts)]).sum(dim=0)
    for copy in copies:
        if copy.grad is None:
            copy.grad = total.clone()
        else:  # in place: .grad may be a view into a flat gradient buffer
            copy.grad.copy_(total)
