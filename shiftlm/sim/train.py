"""One training step of a layout on a cluster: the real pipeline schedule, timed by the pipeline IR.

step = makespan of `shiftlm.pipeline.simulator.simulate` on the schedule `build_schedule` produces,
       with per-stage F / I / W costs per micro-batch (layers + TP/SP collectives) and p2p costs
     + the DP gradient sync left exposed (all of it, or what the last micro-batch's backward of
       the stage does not hide when `overlap_grad_sync`)
     + the optimizer step.
Memory's activation term is one micro-batch's per-chunk activations times the peak number of
chunk activations the schedule keeps alive on a rank (`SimulationResult.peak_activations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shiftlm.config import ModelConfig
from shiftlm.hardware import DTYPE_BYTES, Hardware
from shiftlm.sim import costs, moe
from shiftlm.sim.collectives import (
    Links,
    all_reduce_time,
    all_to_all_time,
    p2p_links,
    p2p_time,
    reduce_scatter_time,
)
from shiftlm.sim.efficiency import FIRST_PRINCIPLES, Efficiency
from shiftlm.sim.layout import Layout, group_placement
from shiftlm.sim.memory import MemoryEstimate, estimate_memory, stage_params
from shiftlm.sim.pipeline_timing import StageCosts, pipeline_timing
from shiftlm.sim.trainer_costs import (
    data_group,
    regathered_stage_costs,
    trainer_pointwise_bytes,
    zero_sync_factor,
)


@dataclass(frozen=True)
class SplitMode:
    """How the micro-batches a zero-bubble schedule splits into I + W run where the rest run otherwise:
    under `train.compile` the trainer queues their weight gradients from Python, so their blocks run
    eagerly (model/compile.py), with an eager block's pointwise traffic (`Layout.pointwise_bytes`)
    and host time (`efficiency`)."""

    pointwise_bytes: float
    efficiency: Efficiency


def trainer_split(
    model: ModelConfig, dtype_bytes: int, compiled: bool, eager: Efficiency
) -> SplitMode | None:
    """How the trainer runs the micro-batches a zero-bubble schedule splits: eagerly (the `eager`
    efficiency: a calibrated profile's eager host time) where its blocks are compiled; None where
    they run eagerly anyway."""
    if not compiled:
        return None
    return SplitMode(trainer_pointwise_bytes(model, dtype_bytes, compiled=False), eager)


def step_stage_costs(
    model: ModelConfig,
    layout: Layout,
    hardware: Hardware,
    efficiency,
    dtype: str,
    split: SplitMode | None = None,
):
    """Every stage-chunk's F, I, W and hand-off of one micro-batch as the step runs them: the layer
    costs, plus ZeRO-3's per-micro-batch gathers and a framework's activation traffic (what
    `simulate_step` and the fitter's re-timing both use); with `split`, the split micro-batches'
    own costs beside them (`StageCosts.split`)."""
    stage = stage_costs(model, layout, hardware, efficiency, dtype, layout.pp * layout.chunks)
    stage = regathered_stage_costs(stage, model, layout, hardware, efficiency)
    stage = grad_accumulation_stage_costs(stage, model, layout, hardware, efficiency)
    stage = zero3_copy_stage_costs(stage, model, layout, hardware, efficiency)
    stage = activation_traffic_stage_costs(stage, model, layout, hardware, efficiency)
    if split is None or layout.pp == 1:
        return stage
    eager = replace(layout, pointwise_bytes=split.pointwise_bytes)
    return replace(stage, split=step_stage_costs(model, eager, hardware, split.efficiency, dtype))


def zero3_copy_stage_costs(stage, model: ModelConfig, layout: Layout, hardware: Hardware, efficiency):
    """ZeRO-3's copies around its collectives: `layout.zero3_copy_bytes` HBM bytes per unsharded
    parameter of the stage-chunk in each micro-batch, memory-bound, charged to the chunk's
    backward (the pass that runs most of them: the second gather's copy-out and the gradients'
    copy-in; with one stage where it lands does not change the step)."""
    if layout.zero < 3 or layout.zero3_copy_bytes <= 0:
        return stage
    chunks = len(stage.forward)
    per_chunk = stage_params(model, layout) * layout.pp / chunks
    seconds = per_chunk * layout.zero3_copy_bytes / (hardware.hbm_bandwidth * efficiency.memory)
    return replace(stage, backward_input=[i + seconds for i in stage.backward_input])


def grad_accumulation_stage_costs(stage, model: ModelConfig, layout: Layout, hardware: Hardware, efficiency):
    """Each micro-batch's backward adds its weight gradients into the trainer's gradient buffer:
    `layout.grad_accumulation_bytes` HBM bytes per parameter of the stage-chunk (its layers, and the
    embedding or LM head on the first and last chunk), memory-bound, in every W."""
    if layout.grad_accumulation_bytes <= 0:
        return stage
    chunks = len(stage.forward)
    # the first micro-batch's gradients are written, not added: (m - 1) adds over m micro-batches
    share = (layout.microbatches - 1) / layout.microbatches
    per_byte = (
        share * layout.grad_accumulation_bytes / (hardware.hbm_bandwidth * efficiency.memory * layout.tp)
    )
    layers = model.num_layers / chunks * model.layer_params * per_byte
    weight = [layers] * chunks
    weight[0] += model.embedding_params * per_byte
    weight[-1] += model.embedding_params * per_byte if chunks > 1 or not model.tie_word_embeddings else 0.0
    return replace(stage, backward_weight=[w + extra for w, extra in zip(stage.backward_weight, weight)])


def activation_traffic_stage_costs(stage, model: ModelConfig, layout: Layout, hardware: Hardware, efficiency):
    """A framework's activation copies beyond the kernels `costs.forward_ops` lists (layout changes,
    casts): `efficiency.activation_bytes` HBM bytes per token per hidden unit per layer (a fitted
    framework parameter) plus `layout.pointwise_bytes` per token per layer (an eager framework's
    unfused pointwise ops, counted from its source) in each forward, twice that in each backward,
    and the forward's again where the recompute replays the pointwise ops (full, or per-op SAC)."""
    per_token = efficiency.activation_bytes * model.hidden_size + layout.pointwise_bytes
    if per_token <= 0:
        return stage
    stages = len(stage.forward)
    tokens = layout.micro_batch * layout.seq_len / (layout.sp * layout.cp)
    layers = model.num_layers / stages
    forward = per_token * tokens * layers
    forward /= hardware.hbm_bandwidth * efficiency.memory
    backward = (2 + (layout.recompute in ("full", "op"))) * forward
    return replace(
        stage,
        forward=[f + forward for f in stage.forward],
        backward_input=[i + backward for i in stage.backward_input],
    )


def stage_costs(
    model: ModelConfig,
    layout: Layout,
    hardware: Hardware,
    efficiency: Efficiency,
    dtype: str,
    num_stages: int,
) -> StageCosts:
    """F / I / W for each of `num_stages` stages (layers split evenly; the embedding on the first
    stage, LM head and loss on the last)."""
    links = Links.of(hardware, efficiency)
    width = DTYPE_BYTES[dtype]
    shard = costs.Shard(
        sp=layout.sp,
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        cp=layout.cp,
        flash_attention=layout.flash_attention,
        dtype_bytes=width,
        ep=layout.ep,
        expert_tp=layout.expert_tp,
    )
    tokens = layout.micro_batch * layout.seq_len
    tp_links = group_placement(layout, "tp", hardware.gpus_per_node)
    sp_links = group_placement(layout, "sp", hardware.gpus_per_node)
    comm = costs.layer_comm_time(model, tokens, shard, tp_links, sp_links, links)
    if layout.ep > 1:  # dispatch and combine all-to-alls of each MoE layer (sim/moe.py)
        ep_per_node, ep_nodes = moe.ep_placement(layout, hardware.gpus_per_node)
        if layout.ep_dispatcher == "deepep" and ep_nodes > 1:
            # DeepEP's RDMA leg reaches about the NIC's line rate (its published normal-kernel
            # bottleneck bandwidth on 50 GB/s CX7 NICs: 43-58 GB/s, docs/legacy.md): the
            # first-principles InfiniBand share, not the one fitted to Megatron-LM's NCCL collectives
            a2a = moe.deepep_time(
                model,
                layout,
                width,
                ep_per_node,
                ep_nodes,
                links.intra_bandwidth,
                hardware.inter_node_bandwidth * FIRST_PRINCIPLES.inter_comm,
                links.inter_latency,
            )
        else:
            a2a = all_to_all_time(moe.dispatch_bytes(model, layout, width), ep_per_node, ep_nodes, links)
        comm += 2 * a2a * moe.moe_share(model)
    exchange = moe.etp_exchange_bytes(model, layout, width)
    if exchange:  # etp != tp: the etp group gathers the dispatched tokens and reduce-scatters outputs
        etp_links = moe.etp_placement(layout, hardware.gpus_per_node)
        comm += 2 * reduce_scatter_time(exchange, *etp_links, links) * moe.moe_share(model)
    ring_backward = 0.0
    if layout.cp > 1:  # ring attention: transfers overlap the attention blocks; only the rest shows
        ops = costs.forward_ops(model, layout.micro_batch, layout.seq_len, layout.seq_len, shard)
        attention = costs.kernels_time(
            [op for op in ops if "attention" in op.name], hardware, efficiency, dtype
        )
        crosses = group_placement(layout, "cp", hardware.gpus_per_node)[1] > 1
        ring_forward, ring_backward = costs.ring_exposed_time(model, tokens, shard, attention, crosses, links)
        comm += ring_forward
        ring_backward -= ring_forward  # layer_pass_costs adds the forward's comm to the backward too
    host_ops = costs.LAYER_OPS_FORWARD
    if layout.megatron_core_moe:
        host_ops = moe.megatron_core_moe_layer_ops(model, layout, host_ops)
    layer = costs.layer_pass_costs(
        model,
        layout.micro_batch,
        layout.seq_len,
        shard,
        layout.recompute,
        hardware,
        efficiency,
        dtype,
        comm,
        host_ops_forward=host_ops,
    )
    layer = replace(layer, backward_input=layer.backward_input + ring_backward)
    head = costs.head_pass_costs(model, tokens, shard, hardware, efficiency, dtype)
    layers = model.num_layers / num_stages
    comm_per_stage = layers * (comm * (3 if layout.recompute == "full" else 2) + ring_backward)
    forward = [layers * layer.forward] * num_stages
    backward_input = [layers * layer.backward_input] * num_stages
    backward_weight = [layers * layer.backward_weight] * num_stages
    forward[-1] += head.forward
    backward_input[-1] += head.backward_input
    backward_weight[-1] += head.backward_weight
    # vocab-parallel embedding: one all-reduce of the embedded tokens in forward (Megatron 2019, Sec. 3)
    if layout.tp > 1:
        forward[0] += all_reduce_time(
            tokens / (layout.sp * layout.cp) * model.hidden_size * width, *tp_links, links
        )
    activation_bytes = (
        tokens / (layout.sp * layout.cp) * model.hidden_size * width / layout.tp
    )  # scatter-gather p2p
    crosses = group_placement(layout, "pp", hardware.gpus_per_node)[1] > 1
    p2p = p2p_time(activation_bytes, crosses, p2p_links(hardware, efficiency)) if layout.pp > 1 else 0.0
    if layout.blocking_p2p and p2p:  # each stage waits for its own send: forward out, gradient back
        forward = [f + p2p for f in forward[:-1]] + forward[-1:]
        backward_input = backward_input[:1] + [b + p2p for b in backward_input[1:]]
        if layout.tp > 1 and not layout.sequence_parallel:
            # Megatron-LM's scatter/gather hand-off (Narayanan et al. 2021, Sec. 4.1): each tp rank
            # sends 1/tp of the (tp-replicated) activation and the receiver all-gathers it over
            # the tp group before it can start (with Megatron SP the activation is sharded already)
            gather = reduce_scatter_time(activation_bytes * layout.tp, *tp_links, links)
            forward = forward[:1] + [f + gather for f in forward[1:]]
            backward_input = [b + gather for b in backward_input[:-1]] + backward_input[-1:]
    return StageCosts(forward, backward_input, backward_weight, [comm_per_stage] * num_stages, p2p)


@dataclass
class StepResult:
    step_time: float
    tokens_per_s: float
    tflops_per_gpu: float  # model FLOPs (no recompute) per second per GPU
    mfu: float
    bubble_fraction: float
    memory: MemoryEstimate
    breakdown: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "step_time_s": self.step_time,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "memory_gib": self.memory.as_dict(),
            "oom": not self.memory.fits,
            "breakdown_s": self.breakdown,
        }


def grad_sync_time(
    model: ModelConfig, layout: Layout, hardware: Hardware, efficiency: Efficiency, dtype: str
) -> float:
    """DP sync of one rank's gradients after the pipeline: an all-reduce at ZeRO-0/1; at ZeRO-2 the
    parameter all-gather (the gradients are reduce-scattered per micro-batch inside the backward, priced
    in the stage costs by `trainer_costs`); nothing at ZeRO-3 (its gathers are there too). The group
    is the trainer's `dp_sp`: DP replicas, cp and Ulysses peers hold the same weights and see
    different tokens (ranks per node and nodes: the products over the three axes)."""
    if layout.dp * layout.cp * layout.sp == 1:
        return 0.0
    experts = moe.stage_expert_params(model, layout)
    nbytes = (stage_params(model, layout) - experts) * DTYPE_BYTES[dtype]
    placement = (1, 1)
    for axis in ("dp", "cp", "sp"):
        per_node, nodes = group_placement(layout, axis, hardware.gpus_per_node)
        placement = (placement[0] * per_node, placement[1] * nodes)
    links = Links.of(hardware, efficiency)
    time = all_reduce_time(nbytes, *placement, links)
    if experts:  # expert gradients are summed over their edp group only (docs/moe.md)
        edp = moe.edp_placement(layout, hardware.gpus_per_node)
        time += all_reduce_time(experts * DTYPE_BYTES[dtype], *edp, links)
    return time * zero_sync_factor(layout)


def tied_embedding_sync_time(
    model: ModelConfig, layout: Layout, hardware: Hardware, efficiency: Efficiency, dtype: str
) -> float:
    """With tied word embeddings and a pipeline, the first stage's embedding and the last stage's LM
    head are two copies of one weight: after the backward their gradients are summed by an all-reduce
    between the two ranks (V x h / tp gradient elements per tp rank) before the optimizer step
    (Megatron-LM `_allreduce_embedding_grads`, DeepSpeed's `_exec_reduce_tied_grads`,
    `pipeline/tied.sync_tied_embedding_grads` here). With sharded gradients (ZeRO-2/3) shiftlm sums
    the two copies' shards instead (`train/grad_shards.sync_tied`): 1/N of it, N the data group."""
    if layout.pp == 1 or not model.tie_word_embeddings:
        return 0.0
    nbytes = model.vocab_size * model.hidden_size / layout.tp * DTYPE_BYTES[dtype]
    if layout.zero >= 2:
        nbytes /= data_group(layout)
    crosses = group_placement(layout, "pp", hardware.gpus_per_node)[1] > 1
    return all_reduce_time(nbytes, *((1, 2) if crosses else (2, 1)), Links.of(hardware, efficiency))


def step_overheads(
    model: ModelConfig,
    layout: Layout,
    hardware: Hardware,
    efficiency: Efficiency,
    dtype: str,
    stage: StageCosts,
) -> tuple[float, float]:
    """(gradient syncs left exposed after the pipeline, optimizer step): what a step adds to the
    makespan. The tied-embedding all-reduce runs after the backward, as the optimizer waits for it."""
    sync = grad_sync_time(model, layout, hardware, efficiency, dtype)
    last_backward = max(i + w for i, w in zip(stage.backward_input, stage.backward_weight))
    exposed_sync = max(0.0, sync - last_backward) if layout.overlap_grad_sync else sync
    exposed_sync += tied_embedding_sync_time(model, layout, hardware, efficiency, dtype)
    replicas = layout.dp * layout.cp * layout.sp  # the ZeRO group is the trainer's dp_sp
    local_params = moe.zero_sharded(
        stage_params(model, layout),
        moe.stage_expert_params(model, layout),
        layout,
        replicas,
        layout.zero >= 1,
    )
    return exposed_sync, costs.optimizer_time(local_params, hardware, efficiency, layout.optimizer_bytes)


def simulate_step(
    model: ModelConfig,
    layout: Layout,
    hardware: Hardware,
    efficiency: Efficiency = FIRST_PRINCIPLES,
    dtype: str = "bf16",
    split: SplitMode | None = None,
) -> StepResult:
    """Simulate one optimizer step of `layout` (see the module docstring for the composition); `split`:
    how micro-batches a zero-bubble schedule splits run, where not as the rest (`SplitMode`)."""
    layout.check()
    layout.check_model(model)
    stage = step_stage_costs(model, layout, hardware, efficiency, dtype, split)
    timing = pipeline_timing(layout, stage)
    makespan, bubble, peak = timing.makespan, timing.bubble_fraction, timing.peak_activations
    busiest, busiest_stages = max(timing.busy), timing.busiest_stages
    exposed_sync, optimizer = step_overheads(model, layout, hardware, efficiency, dtype, stage)
    step = makespan + exposed_sync + optimizer

    tokens = layout.global_batch * layout.seq_len
    causal = layout.flash_attention  # the kernels skip the upper triangle; MFU counts what they run
    model_flops = model.flops_per_token(layout.seq_len, causal) * tokens
    comm = sum(stage.comm[s] for s in busiest_stages) * layout.microbatches
    memory = estimate_memory(model, layout, peak, hardware.hbm_bytes, DTYPE_BYTES[dtype])
    return StepResult(
        step_time=step,
        tokens_per_s=tokens / step,
        tflops_per_gpu=model_flops / step / layout.gpus / 1e12,
        mfu=model_flops / (step * layout.gpus * hardware.device_peak(dtype)),
        bubble_fraction=bubble,
        memory=memory,
        breakdown={
            "compute": busiest - comm,
            "tp_sp_comm": comm,
            "pipeline_bubble_and_p2p": makespan - busiest,
            "dp_sync_exposed": exposed_sync,
            "optimizer": optimizer,
        },
    )
