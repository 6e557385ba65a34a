"""Run one batch through a layout and through Hugging Face `transformers`, and compare.

`layout_outputs` runs on every rank of a layout (under `shiftlm.launch.LocalWorkers` or torchrun) and
returns, gathered to whole tensors, the logits, the loss gradient with respect to the input
embeddings, and optionally every parameter gradient (summed over shards). `reference_outputs`
computes the same three things with `transformers` in one process. The loss is the sum of per-token
cross-entropies divided by the global number of targets.

Relative error, as reported everywhere: max |ours - reference| / max |reference|.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shiftlm.comm import gather_replicated
from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.mesh import Mesh
from shiftlm.model.loss import IGNORE_INDEX
from shiftlm.parallel import ParallelConfig


@dataclass
class Outputs:
    logits: torch.Tensor
    embedding_grad: torch.Tensor
    param_grads: dict[str, torch.Tensor] | None = None


def fixed_batch(
    vocab_size: int, batch: int = 2, seq_len: int = 16, seed: int = 1234
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets (the last position has no target)."""
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, :-1] = ids[:, 1:]
    return ids, targets


def data_ranks(tp: int, ep: int, etp: int = 0) -> int:
    """The data-parallel ranks a parity layout splits the batch over: ep (each ep rank a slice), or
    with a separate etp the ep x etp / tp that the experts' ranks fold over (docs/moe.md)."""
    return ep if etp in (0, tp) else max(1, ep * etp // tp)


def check_batch(batch: int, dp: int) -> None:
    if batch % dp:
        raise ConfigError(
            f"batch {batch} does not split over {dp} data-parallel (ep) ranks: use a multiple of {dp}"
        )


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max abs reference)."""
    abs_err = (ours.double() - reference.double()).abs().max().item()
    scale = reference.double().abs().max().item()
    return abs_err, abs_err / scale if scale else abs_err


def layout_outputs(
    model_dir: str,
    tp: int = 1,
    sp: int = 1,
    sequence_parallel: bool = False,
    batch: int = 2,
    seq_len: int = 16,
    param_grads: bool = False,
    cp: int = 1,
    device: str | None = None,
    autocast: bool = False,
    ep: int = 1,
    dp: int | None = None,
    dispatch: str = "all_to_all",
    etp: int = 0,
) -> Outputs:
    """Per-rank: build the layout from `model_dir`, run forward + backward, return whole tensors (on
    the CPU). `device`: where the rank computes (default: the process group's, see `Mesh`);
    `autocast`: the forward in bf16 autocast over fp32 weights, as training runs on GPUs. `ep`: expert
    parallelism over `dp` data-parallel ranks (default dp = ep), each with a slice of the batch; the
    MoE load-balancing loss joins the loss when the config asks (`output_router_logits`); `dispatch`:
    how tokens reach their experts' ranks (`moe.SparseMoE.dispatch`); `etp`: the experts' own TP size
    (0: tp), then over `data_ranks` data-parallel ranks by default."""
    from shiftlm.model import build_model
    from shiftlm.model.grads import sync_tp_replicated_grads
    from shiftlm.model.ring_attention import sequence_indices, unzigzag
    from shiftlm.model.weights import gather_full

    config = ModelConfig.from_hf(model_dir)
    dp = data_ranks(tp, ep, etp) if dp is None else dp
    parallel = ParallelConfig(dp=dp, tp=tp, sp=sp, cp=cp, sequence_parallel=sequence_parallel, ep=ep, etp=etp)
    parallel.check_sequence(seq_len)
    check_batch(batch, dp)
    mesh = Mesh(parallel, device=device)
    model = build_model(config, mesh, checkpoint=model_dir)
    for module in model.modules():
        if hasattr(module, "dispatch"):
            module.dispatch = dispatch
    ids, targets = fixed_batch(config.vocab_size, batch, seq_len)
    rows = slice(mesh.coords.dp * batch // dp, (mesh.coords.dp + 1) * batch // dp)
    index = torch.from_numpy(sequence_indices(seq_len, cp, mesh.cp.rank, sp, mesh.sp.rank))
    ids_local, targets_local = ids[rows][:, index].to(mesh.device), targets[rows][:, index].to(mesh.device)

    captured = {}

    def keep_embedding(_module, _inputs, output):
        output.retain_grad()
        captured["embedding"] = output

    model.model.embed_tokens.register_forward_hook(keep_embedding)
    with torch.autocast(mesh.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids_local)
    num_targets = int((targets != IGNORE_INDEX).sum())
    loss = model.loss(logits.float(), targets_local).sum() / num_targets
    if config.is_moe and config.output_router_logits:
        loss = loss + config.router_aux_loss_coef * model.router_aux_loss()[0]
    loss.backward()

    with torch.no_grad():
        whole = gather_replicated(logits, mesh.tp, dim=-1)[..., : config.vocab_size]
        whole = unzigzag(gather_replicated(gather_replicated(whole, mesh.sp, dim=1), mesh.cp, dim=1), cp)
        whole = gather_replicated(whole, mesh.dp, dim=0)
        grad = captured["embedding"].grad
        if model.sequence_parallel:
            grad = gather_replicated(grad, mesh.tp, dim=1)
        grad = unzigzag(gather_replicated(gather_replicated(grad, mesh.sp, dim=1), mesh.cp, dim=1), cp)
        grad = gather_replicated(grad, mesh.dp, dim=0)
    sync_tp_replicated_grads(model)
    grads = gather_full(model, grads=True) if param_grads else None
    if grads is not None:
        grads = {name: g.cpu() for name, g in grads.items()}
    return Outputs(whole.detach().float().cpu(), grad.detach().float().cpu(), grads)


def reference_outputs(
    model_dir: str,
    batch: int = 2,
    seq_len: int = 16,
    param_grads: bool = False,
    device: str = "cpu",
    autocast: bool = False,
) -> Outputs:
    """The same quantities from `transformers` (fp32 weights, eager attention) on the same checkpoint,
    on `device`, optionally in bf16 autocast; returned on the CPU."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).to(device)
    config = ModelConfig.from_hf(model_dir)
    ids, targets = fixed_batch(config.vocab_size, batch, seq_len)
    ids, targets = ids.to(device), targets.to(device)
    embeddings = hf.get_input_embeddings()(ids).detach().requires_grad_(True)
    aux = config.is_moe and config.output_router_logits
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
        out = hf(inputs_embeds=embeddings, **({"output_router_logits": True} if aux else {}))
    logits = out.logits
    per_token = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    loss = per_token / int((targets != IGNORE_INDEX).sum())
    if aux:  # transformers' load_balancing_loss_func, weighted as its own loss weighs it
        loss = loss + config.router_aux_loss_coef * out.aux_loss
    loss.backward()
    grads = None
    if param_grads:
        grads = {name: p.grad.detach().cpu() for name, p in hf.named_parameters() if p.grad is not None}
        # the input embedding's own gradient flows through `embeddings` here, not the table
        grads.pop("model.embed_tokens.weight", None)
    return Outputs(logits.detach().float().cpu(), embeddings.grad.detach().float().cpu(), grads)
