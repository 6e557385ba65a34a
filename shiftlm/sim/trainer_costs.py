"""What `shiftlm train` itself costs beyond the generic (Megatron-style) model: its memory, ZeRO-3 and
its eager blocks' pointwise traffic (`trainer_pointwise_bytes`).

The generic memory model (`memory.py`) counts mixed-precision states (2 + 2 + 12 bytes per parameter,
sharded by the ZeRO stage as in Rajbhandari et al. 2020). shiftlm's trainer keeps, per parameter on
a rank (`train/flat.py`, `train/zero.py`, `train/trainer.py`):
- weights: the flat fp32 buffer (4 bytes); at ZeRO-3 the fp32 master shard (4/N) plus the units
  gathered at once (the one in use and the prefetched next: two of the largest unit);
- gradients: below ZeRO-2 the flat fp32 gradient buffer (4) and the fp32 grad-norm mask beside it
  (4); at ZeRO-2/3 (`train/grad_shards.py`) the fp32 gradient shard and the norm mask's shard (8/N)
  plus two of the largest unit in transit (one filling, one being reduce-scattered); BitPipe's
  replica-summed stages keep their autograd gradients (4) until the step's end on top;
- optimizer: Adam m and v and the weight-decay mask over the owned range (12/N from ZeRO-1, 12/1
  below), N = the data group dp x cp x sp; at ZeRO-1/2 also the parameter refill's input buffer (4/N).
A plan is priced (and checked to fit) with these, so what the planner proposes fits the trainer.
Above the states, the step's transient peak is the larger of (a) the activations autograd saves for
the in-flight micro-batches, counted from shiftlm's own layer (`layer_saved_elements`; Korthikanti's
count is 20% short of it: no dropout masks, but fp32 RMSNorm keeps x and x-hat, SwiGLU keeps four
ffn-wide tensors, attention keeps its output and o_proj's contiguous input) plus three logits-sized
fp32 tensors (the logits, the cross-entropy's exponentials, the logits' gradient) over the tokens of
one chunk of the fused head + loss (`train.loss_chunk`, `model/loss.py`; the whole micro-batch with
`loss_chunk = 0`), and
(b) the AdamW update's four temporaries over the owned range (`optimizer_transient`: the clipped
gradient, the bias-corrected denominator, the decay factor and its complement; `train/optim.py`).
Checked against the trainer's measured allocation peak in tests/train/test_memory_model.py and
bench/memory_model.py.

ZeRO-3 re-gathers every unit for every micro-batch's forward and again for its backward (FSDP's
`reshard_after_forward`), in fp32, each gather prefetched behind the previous unit's compute. At
ZeRO-2/3 every micro-batch's backward reduce-scatters each unit's fp32 gradients as the unit
completes, overlapped with the next unit's backward (`regathered_stage_costs`); the step's own DP
sync is then ZeRO-2's parameter all-gather (half an all-reduce) and nothing at ZeRO-3
(`zero_sync_factor`).
"""

from __future__ import annotations

from dataclasses import replace

from shiftlm.config import LOSS_CHUNK, ModelConfig
from shiftlm.hardware import Hardware
from shiftlm.sim.collectives import Links, reduce_scatter_time
from shiftlm.sim.efficiency import Efficiency
from shiftlm.sim.layout import Layout, eager_llama_pointwise_bytes, group_placement
from shiftlm.sim.memory import MemoryEstimate, estimate_memory, stage_params
from shiftlm.sim.moe import (
    dispatched_rows,
    expert_layer_params,
    ffn_width,
    stage_expert_params,
    zero_sharded,
)

FP32 = 4


def trainer_pointwise_bytes(model: ModelConfig, dtype_bytes: int, compiled: bool) -> float:
    """`Layout.pointwise_bytes` of the trainer's decoder block (`train.compile`): 0 compiled (inductor
    fuses the pointwise ops into about `costs.forward_ops`' kernels); eager, the Llama block's unfused
    ops (`eager_llama_pointwise_bytes`) without repeat_kv's copies (`model/attention.causal_attention`
    lets SDPA broadcast the KV heads, on CUDA and on the CPU)."""
    return 0.0 if compiled else eager_llama_pointwise_bytes(model, dtype_bytes, repeat_kv=False)


def data_group(layout: Layout) -> int:
    """The trainer's ZeRO / gradient group `dp_sp`: DP replicas, cp and Ulysses peers."""
    return layout.dp * layout.cp * layout.sp


def largest_unit(model: ModelConfig, layout: Layout) -> float:
    """Parameters of the largest ZeRO-3 unit on a rank (a decoder layer, or the embedding / head)."""
    experts = expert_layer_params(model)
    layer = (model.layer_params - experts) / layout.tp + experts / (layout.ep * layout.expert_tp)
    return max(layer, model.embedding_params / layout.tp)


def trainer_states(model: ModelConfig, layout: Layout) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes the trainer keeps on the busiest rank (module docstring)."""
    params = stage_params(model, layout)
    n = data_group(layout)
    # the owned range: 1/n of the dense parameters, 1/edp of the experts' (sim/moe.py)
    owned = zero_sharded(params, stage_expert_params(model, layout), layout, n, True)
    weights = FP32 * params
    if layout.zero >= 3 and n > 1:
        weights = FP32 * owned + 2 * FP32 * largest_unit(model, layout)
    gradients = 2 * FP32 * params  # the flat gradient buffer and the grad-norm mask
    if layout.zero >= 2 and n > 1:  # the shard and its norm mask, plus two units in transit
        gradients = 2 * FP32 * owned + 2 * FP32 * largest_unit(model, layout)
        if layout.schedule == "bitpipe":  # replica-synced stages keep `.grad` until the step's end
            gradients += FP32 * params
    optimizer = 3 * FP32 * (owned if layout.zero >= 1 else params)  # m, v and the decay mask
    if layout.zero in (1, 2) and n > 1:  # the parameter refill's input buffer (train/zero.py)
        optimizer += FP32 * owned
    return weights, gradients, optimizer


def layer_saved_elements(model: ModelConfig, layout: Layout) -> float:
    """Elements one decoder layer saves for backward per micro-batch (recompute none / selective),
    counted from shiftlm's layer: per token 2 x (x, x-hat) of the two RMSNorms and the attention
    norm's weighted output (5h), q, attention output and o_proj's input (3 q_dim / tp), k and v
    (2 kv_dim / tp, before the GQA expansion), gate, up, silu(gate) and their product (4 ffn / tp)."""
    tokens = layout.micro_batch * layout.seq_len / (layout.sp * layout.cp)
    q_dim = model.num_heads * model.head_dim
    kv_dim = model.num_kv_heads * model.head_dim
    sharded = (3 * q_dim + 2 * kv_dim + 4 * ffn_width(model)) / layout.tp
    return tokens * ((5 + dispatched_rows(model)) * model.hidden_size + sharded)


def optimizer_transient(model: ModelConfig, layout: Layout) -> float:
    """Bytes of the AdamW update's four fp32 temporaries over this rank's owned range."""
    params = stage_params(model, layout)
    owned = zero_sharded(
        params, stage_expert_params(model, layout), layout, data_group(layout), layout.zero >= 1
    )
    return 4 * FP32 * owned


def trainer_memory(
    model: ModelConfig,
    layout: Layout,
    peak_in_flight: float,
    capacity: float,
    activation_bytes: int,
    reserve: float | None = None,
    loss_chunk: int = LOSS_CHUNK,
) -> MemoryEstimate:
    """The generic estimate with the trainer's own states in place of 2/2/12 and its transient peak
    (module docstring) as `activations`; under full recompute the generic activation count.
    `loss_chunk`: the run's `train.loss_chunk` (tokens whose logits exist at once; 0: all)."""
    generic = estimate_memory(model, layout, peak_in_flight, capacity, activation_bytes)
    weights, gradients, optimizer = trainer_states(model, layout)
    activations = generic.activations
    if layout.recompute != "full":
        layers = model.num_layers / (layout.pp * layout.chunks)
        saved = peak_in_flight * layers * layer_saved_elements(model, layout) * activation_bytes
        # the fp32 logits, the cross-entropy's exponentials and, in backward, the logits' gradient
        tokens = layout.micro_batch * layout.seq_len / (layout.sp * layout.cp)
        rows = min(tokens, loss_chunk) if loss_chunk else tokens
        activations = saved + 3 * FP32 * rows * model.vocab_size / layout.tp
    activations = max(activations, optimizer_transient(model, layout))  # the step's transient peak
    memory = replace(
        generic, weights=weights, gradients=gradients, optimizer=optimizer, activations=activations
    )
    return memory if reserve is None else replace(memory, reserve=reserve)


def trainer_step_memory(
    model: ModelConfig, layout: Layout, capacity: float, activation_bytes: int
) -> MemoryEstimate:
    """`trainer_memory` with the schedule's own peak of in-flight micro-batches (the planner's check)."""
    from shiftlm.pipeline.peak import peak_in_flight

    in_flight = 1
    if layout.pp > 1:
        in_flight = peak_in_flight(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    return trainer_memory(model, layout, in_flight, capacity, activation_bytes)


def _data_placement(layout: Layout, hardware: Hardware) -> tuple[int, int]:
    placement = (1, 1)
    for axis in ("dp", "cp", "sp"):
        per_node, nodes = group_placement(layout, axis, hardware.gpus_per_node)
        placement = (placement[0] * per_node, placement[1] * nodes)
    return placement


def regathered_stage_costs(
    stage, model: ModelConfig, layout: Layout, hardware: Hardware, efficiency: Efficiency
):
    """ZeRO-2/3: add to every stage's backward (per micro-batch) the unit reduce-scatters of its
    gradients, and at ZeRO-3 to its forward and backward the gathers it waits for. The first gather
    (the last reduce-scatter) is exposed; the others overlap the neighbouring layer's compute, so only
    `max(0, collective - layer compute)` shows. Both are fp32 (the trainer's) over the largest unit."""
    if layout.zero < 2 or data_group(layout) == 1:
        return stage
    links = Links.of(hardware, efficiency)
    # an all-gather is the mirror image of a reduce-scatter (same ring steps and bytes)
    collective = reduce_scatter_time(
        FP32 * largest_unit(model, layout), *_data_placement(layout, hardware), links
    )
    layers = model.num_layers / len(stage.forward)

    def exposed(pass_time: float) -> float:
        return collective + max(layers - 1, 0) * max(0.0, collective - pass_time / layers)

    backward = [i + w for i, w in zip(stage.backward_input, stage.backward_weight)]
    scatter = [exposed(b) for b in backward]  # the gradients' reduce-scatters
    if layout.zero < 3:
        return replace(stage, backward_input=[i + r for i, r in zip(stage.backward_input, scatter)])
    return replace(
        stage,
        forward=[f + exposed(f) for f in stage.forward],
        backward_input=[i + exposed(b) + r for i, b, r in zip(stage.backward_input, backward, scatter)],
    )


def zero_sync_factor(layout: Layout) -> float:
    """The step's own DP sync in all-reduces of the stage's gradients: one below ZeRO-2; at ZeRO-2
    the parameter all-gather after the update (half), the gradients being reduce-scattered inside
    every micro-batch's backward; at ZeRO-3 none (gathers and reduce-scatters are in the stage costs)."""
    return {0: 1.0, 1: 1.0, 2: 0.5}.get(layout.zero, 0.0)
