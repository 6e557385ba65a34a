"""A cost-model runner for the serving scheduler: how long one `StepPlan` takes on a layout, and how
many KV blocks the layout's GPUs hold.

A serving layout is `dp` independent engines (data parallelism) of `sp x tp` GPUs each. Every
step of an engine runs in the mode its `StepPlan` names (Shift Parallelism, Hidayetoglu et al. 2025,
Sec. 3; docs/serving.md "The two modes, one cache"):

- SP x TP: the step's N tokens are padded to a multiple of SP (so a decode-only step of 3 sequences
  costs like 8 on SP=8), each rank runs the dense layers on N/SP tokens with weights cut TP ways,
  with TP all-reduces inside and Ulysses all-to-alls of q, k, v and the output around attention.
- TP: all P = SP x TP ranks run every token with weights cut P ways (views of the SP x TP shards)
  and all-reduce over P.

In both modes a rank owns heads/P query heads and (GQA) max(1, kv_heads/P) KV heads of every token,
so the cache per GPU and the attention work per rank are mode-invariant: a shift moves no K/V.

Dense kernels come from `costs.forward_ops` (the one description of a layer) in the weight dtype;
attention is timed here because serving attention is paged and varlen over chunks with different
contexts, and decode attention is bound by reading K/V, which under GQA is kv_heads (not heads) per
token. Activations and communication are bf16, as in FP8 (W8A8) serving with a bf16 KV cache.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

from shiftlm.config import ModelConfig
from shiftlm.hardware import DTYPE_BYTES, Hardware
from shiftlm.parallel import ParallelConfig
from shiftlm.serve.plan import Mode, StepPlan
from shiftlm.sim.collectives import Links
from shiftlm.sim.costs import Kernel, Shard, forward_ops, kernels_time, layer_comm_time, serving_gemms
from shiftlm.sim.efficiency import Efficiency
from shiftlm.sim.memory import RUNTIME_RESERVE_BYTES

ACTIVATION_DTYPE = "bf16"


@dataclass(frozen=True)
class ServeLayout(ParallelConfig):
    """`dp` engines (replicas) of `sp x tp` GPUs, the core's layout type; a step with <= `threshold`
    tokens runs in full TP over the sp x tp GPUs, a larger one in SP x TP (threshold inf: always TP;
    -1: always SP x TP)."""

    threshold: float = math.inf

    @property
    def gpus_per_replica(self) -> int:
        return self.shift_size

    @property
    def gpus(self) -> int:
        return self.world_size

    @property
    def name(self) -> str:
        dp = f"dp{self.dp} x " if self.dp > 1 else ""
        if self.sp == 1:
            return f"{dp}tp{self.tp}"
        if self.threshold == math.inf:
            return f"{dp}tp{self.gpus_per_replica} (weights as sp{self.sp} x tp{self.tp})"
        kind = "sp_tp" if self.threshold < 0 else f"shift@{self.threshold:g}"
        return f"{dp}{kind} sp{self.sp} x tp{self.tp}"


# A step that starts this long after the previous one ended finds the engine's other ranks asleep: a
# rank waiting in a shared-memory collective spins, then yields its core for `WaitPolicy.yield_s`
# (comm/shm.py, 2 ms), then sleeps on a futex, so the step's first collective waits for wake-ups
# (and the step runs on cold caches). `HostOverhead.after_idle` is that step's extra cost.
IDLE_WAKE_S = 2e-3


@dataclass(frozen=True)
class HostOverhead:
    """Seconds of host (CPU) work in one step of one mode that no kernel or collective of the cost
    model accounts for. Zero for an engine whose host work hides behind the device (CUDA graphs,
    async scheduling); measured for the CPU engine by `shiftlm calibrate --serve-model` (probes):

    - `per_step`: every step once: the plan's encode, broadcast and decode, each layer's fixed eager
      dispatch (norms, projections, RoPE, the attention kernel call, the row-parallel sums), the LM
      head and the logits gather;
    - `per_chunk`: per sequence chunk in the plan: its plan entry (encoded in Python on rank 0), its
      attention rows and its sampled logits row;
    - `per_prefill`: per prompt chunk (a chunk of more than one token): the prefill attention group
      that a decode-only step does not build (positions, gather index, per-layer kernel call);
    - `per_token`: per token of the step, what the kernel model misses (elementwise work, copies);
    - `after_idle`: once, on a step that starts after the engine idled for at least `IDLE_WAKE_S`;
    - `per_chunk_layer`: per chunk per layer, an eager per-sequence attention loop; the engine has
      none since attention is batched (serve/worker/paged_attention.py); kept for older profiles (0 when
      fitted now).

    As the engine loop's gap between steps (`EngineProfile.loop_gap`, folded into `host`), `per_step`
    is the loop's fixed work (scheduling, handing outputs over) and `per_chunk` its work per sequence
    (sampling, detokenizing, streaming its token)."""

    per_step: float = 0.0
    per_chunk_layer: float = 0.0
    per_token: float = 0.0
    per_chunk: float = 0.0
    per_prefill: float = 0.0
    after_idle: float = 0.0

    def seconds(self, chunks: int, tokens: int, prefills: int, layers: int, idle: bool = False) -> float:
        """A step of `chunks` sequence chunks (`prefills` of them prompt chunks) and `tokens` tokens;
        `idle`: it starts after the engine idled (at least IDLE_WAKE_S since the previous step)."""
        return (
            self.per_step
            + (self.per_chunk + self.per_chunk_layer * layers) * chunks
            + self.per_prefill * prefills
            + self.per_token * tokens
            + (self.after_idle if idle else 0.0)
        )

    def time(self, plan: StepPlan, layers: int, idle: bool = False) -> float:
        return self.seconds(len(plan.chunks), plan.num_tokens, prefill_chunks(plan), layers, idle)

    def __add__(self, other: HostOverhead) -> HostOverhead:
        return HostOverhead(*(a + b for a, b in zip(astuple(self), astuple(other))))


def prefill_chunks(plan: StepPlan) -> int:
    """Chunks of more than one token: prompt chunks (a decode row, or a one-token prompt, has one)."""
    return sum(len(chunk.token_ids) > 1 for chunk in plan.chunks)


@dataclass(frozen=True)
class ServeHardware:
    model: ModelConfig
    hardware: Hardware
    efficiency: Efficiency
    dtype: str = "fp8"  # weights and GEMMs
    kv_dtype: str = "bf16"
    host: dict[Mode, HostOverhead] | None = None  # None: host work fully overlapped
    # seconds of a request's path outside the engine (HTTP, tokenizing, streaming the first token
    # back): it reaches the engine this late and counts in its TTFT (measured by calibrate)
    per_request: float = 0.0
    per_request_busy: float | None = None  # the same path while the engine is stepping (None: as idle)


def _group_links(size: int, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of a group of `size` ranks `stride` apart (tp innermost, then sp)."""
    per_node = max(1, min(size, gpus_per_node // stride))
    return per_node, math.ceil(size / per_node)


def serving_links(hardware: Hardware, efficiency: Efficiency) -> Links:
    """The links a serving step's collectives take: a profile that measured the shared-memory
    channel (`shiftlm calibrate`: `extra["shm_latency"]`, `extra["shm_bandwidth"]`) is a CPU host
    whose serving ranks sum, broadcast and gather through it (serve/worker/runner.py, comm/shm.py), not
    through gloo; any other profile, its own links."""
    if "shm_latency" in hardware.extra and "shm_bandwidth" in hardware.extra:
        latency, bandwidth = hardware.extra["shm_latency"], hardware.extra["shm_bandwidth"]
        return Links(bandwidth, bandwidth, latency, latency)
    return Links.of(hardware, efficiency)


class StepCostModel:
    """Seconds for one engine step of a plan on one replica of `layout`."""

    def __init__(self, setup: ServeHardware, layout: ServeLayout):
        self.setup = setup
        self.layout = layout
        self.links = serving_links(setup.hardware, setup.efficiency)
        ranks = layout.gpus_per_replica
        model = setup.model
        self.heads_per_rank = model.num_heads / ranks
        self.kv_heads_per_rank = max(1.0, model.num_kv_heads / ranks)
        self._dense_cache: dict[tuple[Mode, int, int], float] = {}  # steps repeat the same sizes

    def step_time(self, plan: StepPlan, idle: bool = False) -> float:
        """`idle`: the step starts after the engine idled (`HostOverhead.after_idle`)."""
        contexts = tuple((chunk.start, len(chunk.token_ids)) for chunk in plan.chunks)
        key = (plan.mode, plan.num_tokens, plan.num_samples)
        if key not in self._dense_cache:
            self._dense_cache[key] = self._dense_time(*key)
        host = (
            self.setup.host[plan.mode].time(plan, self.setup.model.num_layers, idle)
            if self.setup.host
            else 0.0
        )
        return self._dense_cache[key] + self._attention_time(contexts) + host

    def _shard(self, mode: Mode, dtype_bytes: int) -> Shard:
        if mode is Mode.TP:
            return Shard(tp=self.layout.gpus_per_replica, sequence_parallel=False, dtype_bytes=dtype_bytes)
        return Shard(sp=self.layout.sp, tp=self.layout.tp, sequence_parallel=False, dtype_bytes=dtype_bytes)

    def _dense_time(self, mode: Mode, tokens: int, samples: int) -> float:
        """Everything but attention, times layers, plus the LM head on the sampled rows."""
        setup, layout = self.setup, self.layout
        sp = layout.sp if mode is Mode.SP_TP else 1
        padded = math.ceil(tokens / sp) * sp  # Ulysses splits the tokens evenly over SP ranks
        shard = self._shard(mode, DTYPE_BYTES[setup.dtype])
        dense = [
            op for op in forward_ops(setup.model, 1, padded, padded, shard) if op.name != "flash_attention"
        ]
        layer = kernels_time(
            serving_gemms(dense, setup.hardware), setup.hardware, setup.efficiency, setup.dtype
        )
        comm_shard = self._shard(mode, DTYPE_BYTES[ACTIVATION_DTYPE])
        gpn = setup.hardware.gpus_per_node
        tp_links = _group_links(comm_shard.tp, 1, gpn)
        sp_links = _group_links(comm_shard.sp, comm_shard.tp, gpn)
        layer += layer_comm_time(setup.model, padded, comm_shard, tp_links, sp_links, self.links)
        head_rows = math.ceil(samples / sp) * sp
        return setup.model.num_layers * layer + self._head_time(head_rows, shard)

    def _head_time(self, rows: int, shard: Shard) -> float:
        """The final norm and the LM head on this rank's sampled rows (logits only: serving has no
        loss), as `serve.logits.logits_block` splits them: SP x TP, its 1/sp of the rows x 1/tp of
        the vocabulary; full TP, every row x 1/(sp tp) of it (the TP shard's tp = sp x tp)."""
        setup, model = self.setup, self.setup.model
        m, h, vocab = rows / shard.sp, model.hidden_size, model.vocab_size / shard.tp
        nbytes = shard.dtype_bytes * (m * h + h * vocab + m * vocab)
        ops = [
            Kernel("final_norm", 0.0, 2 * m * h * shard.dtype_bytes, False),
            Kernel("lm_head", 2 * m * h * vocab, nbytes, True, (m, h, vocab)),
        ]
        return kernels_time(serving_gemms(ops, setup.hardware), setup.hardware, setup.efficiency, setup.dtype)

    def _attention_time(self, contexts: tuple[tuple[int, int], ...]) -> float:
        """One varlen paged-attention kernel per layer over every chunk (start, new tokens): causal
        FLOPs of the new queries against start + new keys; reads K/V of the whole context."""
        setup, d = self.setup, self.setup.model.head_dim
        act, kv = DTYPE_BYTES[ACTIVATION_DTYPE], DTYPE_BYTES[setup.kv_dtype]
        flops = nbytes = 0.0
        for start, new in contexts:
            queries = new * self.heads_per_rank
            flops += 4 * queries * (start + new / 2) * d
            nbytes += 2 * queries * d * act + 2 * (start + new) * self.kv_heads_per_rank * d * kv
        kernel = Kernel("paged_attention", flops, nbytes, True)
        return setup.model.num_layers * kernels_time(
            [kernel], setup.hardware, setup.efficiency, ACTIVATION_DTYPE
        )


@dataclass(frozen=True)
class KvCapacity:
    """Per-GPU memory split of one replica and the number of KV blocks it leaves."""

    weights_bytes: float
    workspace_bytes: float
    kv_bytes_per_token: float
    num_blocks: int


def kv_capacity(
    setup: ServeHardware, layout: ServeLayout, block_size: int, max_tokens_per_step: int
) -> KvCapacity:
    """Weights (cut `tp` ways: the full-TP mode uses views of them, Sec. 3.3 of the paper), a
    runtime reserve, one step's bf16 working set (serve/worker/kv_memory.activation_bytes) and the
    rest for K/V: 2 x layers x kv_heads_per_rank x head_dim per token."""
    from shiftlm.serve.worker.kv_memory import activation_bytes, kv_bytes_per_block

    model, hardware = setup.model, setup.hardware
    weights = model.num_params * DTYPE_BYTES[setup.dtype] / layout.tp
    # the serving engine's own bound of a step's working set and its per-token K/V bytes
    workspace = activation_bytes(model, layout, max_tokens_per_step, 256, DTYPE_BYTES[ACTIVATION_DTYPE])
    per_token = kv_bytes_per_block(model, layout, 1, DTYPE_BYTES[setup.kv_dtype])
    free = hardware.hbm_bytes - weights - RUNTIME_RESERVE_BYTES - workspace
    blocks = max(0, int(free // (per_token * block_size)))
    return KvCapacity(weights, workspace, per_token, blocks)
