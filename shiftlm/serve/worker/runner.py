"""The model runner: rank 0 sends each step plan as a tensor, every rank runs it, logits come back.

    runner = ModelRunner.load(model_dir, mesh, num_blocks=256, block_size=16)
    if mesh.rank == 0:
        engine = Engine(runner, ...)          # runner.execute(plan) -> logits [samples, vocab]
        ...; runner.stop_workers()
    else:
        runner.serve_steps()                  # loops until rank 0 stops it

The plan travels as one int64 tensor (`plan_codec`: one broadcast of a fixed 1024 ints, header and the
payload when it fits, a second one for the rest of a larger plan), not as a pickle; every rank decodes
it on the host with tensor ops into the same flat batch, applies its block-table deltas to its own
copy of the tables, and moves the batch to its device. Logits come back with one `gather` of the block each
rank owns (`logits.py`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from shiftlm.comm import shm
from shiftlm.comm.wait import run_blocking
from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.mesh import Mesh
from shiftlm.model import build_model
from shiftlm.model.sharding import kv_heads_of_block
from shiftlm.serve.plan import PENDING, Mode, StepPlan
from shiftlm.serve.worker import ATTENTION_BACKENDS
from shiftlm.serve.worker.compiled_step import CompiledDecode
from shiftlm.serve.worker.decode_graphs import DecodeGraphs
from shiftlm.serve.worker.flex_decode import check_flex
from shiftlm.serve.worker.logits import gather_logits, logits_block, logits_layout
from shiftlm.serve.worker.paged_attention import FlatBatch, PagedKVCache
from shiftlm.serve.worker.plan_codec import (
    HEADER,
    STOP_CHUNKS,
    BlockTables,
    decode_plan,
    encode_plan,
    payload_size,
    stop_message,
)
from shiftlm.serve.worker.shift_model import ShiftModel

# Ranks > 0 block in the plan broadcast while the server idles. Groups made by `Mesh` carry gloo's
# default timeout (30 minutes), after which an idle worker would die, so plans get a group of their own.
PLAN_WAIT_TIMEOUT = datetime.timedelta(days=7)
FIRST_MESSAGE = 1024  # int64s of a plan's first broadcast (8 KiB): header + payload when it fits


class ModelRunner:
    """Executes step plans on every rank of one shift group (dp = pp = 1)."""

    def __init__(
        self,
        model_config: ModelConfig,
        shift_model: ShiftModel,
        mesh: Mesh,
        shm_collectives: bool = True,
        max_blocks_per_seq: int | None = None,
    ):
        self.model_config = model_config
        self.shift_model = shift_model
        self.mesh = mesh
        self.cache = shift_model.cache
        # rank 0, mixture-of-experts models: called after each step with its rows per expert
        self.on_expert_rows: Callable[[list[float]], None] | None = None
        # plans are decoded on the host (`_run`): the tables live there, the batch goes to the device
        # as wide as the longest sequence (`load`), not the cache (~340k blocks of an H200 x rows x 8 bytes)
        blocks = self.cache.num_blocks
        self.tables = BlockTables(max_blocks_per_seq or blocks, device="cpu", num_blocks=blocks)
        self._inv_freq = shift_model.model.inv_freq.detach().cpu()  # stream groups' query rotation
        group = mesh.shift
        # new_group is collective: every rank builds the runner, in the same order. The plan's group
        # is gloo whatever the engine's backend: the message is a host tensor (a CPU side-channel under
        # NCCL; idle ranks wait on a socket, not on a GPU kernel), decoded on the engine's device.
        self._plan_group = (
            dist.new_group(list(group.ranks), timeout=PLAN_WAIT_TIMEOUT, backend="gloo")
            if group.size > 1
            else None
        )
        # CPU ranks of one host: the step's collectives (row-parallel sums, the plan, the logits) go
        # through shared memory (comm/shm.py), not gloo's sockets; off with SHIFTLM_SHM_COLLECTIVES=0
        # (read by serve/options.py)
        self._local = None
        if mesh.device.type == "cpu" and shm_collectives:
            from shiftlm.kernels import cpu as cpu_kernels

            kernels = cpu_kernels.load() if group.size > 1 else None
            for each in (group, mesh.tp, mesh.sp):  # the same order on every rank (collective)
                channel = shm.enable(each, kernels)
                if each is group:
                    self._local = channel

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        mesh: Mesh,
        num_blocks: int | None,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        compile_decode: bool = False,
        attention_backend: str = "auto",
        compile_mixed: bool | None = None,
        gemv_rows: int | None = None,
        model_config: ModelConfig | None = None,
        shm_collectives: bool = True,
        memory: tuple[float, int] = (0.9, 0),
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        cuda_graph_sizes: tuple[int, ...] = (),
    ) -> ModelRunner:
        """`compile_decode`: pure decode steps as one compiled function where it applies
        (`compiled_step.py`; the server's default, off with `--enforce-eager`).
        `attention_backend` (`--attention-backend`): "auto" attends decode rows with the CPU
        paged-attention kernel on CPU where it builds (kernels/cpu.py), "cpu-kernel" insists on
        it, "sdpa" always gathers blocks for SDPA, "flex" attends decode rows with FlexAttention from
        the blocks in place (flex_decode.py; a mixed step's decode rows too; prefill chunks gather for SDPA).
        `gemv_rows`: inputs of up to this many rows run MKL's GEMV rather than oneDNN's packed GEMM
        (and the compiled decode covers those batch sizes); None measures which is faster here
        (`PackedWeights.choose_small_rows`). `model_config`: the checkpoint's, when the caller has
        read it already (the server's options have). `num_blocks=None` (GPUs): as many blocks as
        `memory` = (utilization, activation bytes) leaves once the weights are loaded, the same on
        every rank of the group (the smallest). On CUDA with `compile_decode`, decode steps of up to
        `max_num_seqs` sequences and `max_model_len` tokens replay CUDA graphs (decode_graphs.py),
        which take one more KV block (a scratch block for padding rows), at the batch sizes
        `decode_graphs.capture_sizes` makes of `cuda_graph_sizes` (--cuda-graph-sizes). `compile_mixed`: the other
        steps compiled too (`CompiledMixed`; None: with `compile_decode` on CUDA)."""
        backend = attention_backend
        if backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention backend {backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
        config = model_config or ModelConfig.from_hf(model_dir)
        if backend == "flex":  # before any weight is read
            check_flex(mesh.device, block_size, config.head_dim)
        model = build_model(config, mesh, checkpoint=model_dir, dtype=dtype).eval()
        p = mesh.config.sp * mesh.config.tp
        first, last = kv_heads_of_block(mesh.shard_index, p, config.num_kv_heads)
        # CUDA graphs (and their scratch block) only where the compiled step they replay will exist
        graphs = compile_decode and mesh.device.type == "cuda"
        # not for a mixture of experts: a replay runs no Python, so the router's counts per expert
        # (/metrics, the step log) would not be taken
        graphs = graphs and CompiledDecode.supports(model) and not config.is_moe
        if num_blocks is None:
            num_blocks = _blocks_from_memory(config, mesh, block_size, dtype, *memory) - graphs
        cache = PagedKVCache(
            config.num_layers,
            num_blocks,
            block_size,
            last - first,
            config.head_dim,
            dtype,
            mesh.device,
            graphs,
        )
        cache.kernel = _attention_kernel(backend, mesh.device)
        cache.flex = backend == "flex"
        shift_model = ShiftModel(
            model,
            mesh,
            cache,
            compile_decode=compile_decode,
            gemv_rows=gemv_rows,
            compile_mixed=compile_mixed,
        )
        if shift_model.compiled is not None and not shift_model.compiled.warm_up():
            shift_model.compiled = None  # it could not build (warned): every step runs eagerly
        mixed = shift_model.compiled_mixed
        if mixed is not None and not mixed.warm_up(_warm_up_steps(shift_model, mixed.graph_mode)):
            shift_model.compiled_mixed = None
        tokens = max_model_len or config.max_position_embeddings  # the longest context a step can have
        longest = min(num_blocks, -(-tokens // block_size))
        if shift_model.compiled is not None and graphs:
            shift_model.graphs = DecodeGraphs(
                shift_model.compiled, min(max_num_seqs, num_blocks), longest, True, cuda_graph_sizes
            )
            shift_model.graphs.capture_all()
        return cls(config, shift_model, mesh, shm_collectives, longest)

    runs_ahead = True  # `execute` takes a plan's PENDING tokens from the device (async scheduling)

    def execute(self, plan: StepPlan, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Rank 0: run `plan` on all ranks; logits [plan.num_samples, vocab_size]. `pending`: the
        plan's `PENDING` tokens in order, where the previous step drew them (rank 0's device)."""
        message = encode_plan(plan)
        self._send(message)
        logits = self._run(message, pending)[:, : self.model_config.vocab_size]
        rows = self.shift_model.expert_rows
        if self.on_expert_rows is not None and rows is not None:
            self.on_expert_rows(rows.tolist())
        return logits

    def serve_steps(self) -> None:
        """Ranks > 0: run every plan rank 0 sends, until it sends the stop message."""
        while (message := self._receive()) is not None:
            self._run(message)

    def stop_workers(self) -> None:
        self._send(stop_message())

    def _send(self, message: torch.Tensor) -> None:
        """One broadcast of a fixed `FIRST_MESSAGE` ints (the header and as much of the payload as fits;
        a decode step of 64 sequences fits), a second one only for the rest: every collective is a
        point where all ranks wait for the slowest, which on a loaded machine costs more than bytes."""
        if self._plan_group is not None:
            src = self.mesh.shift.ranks[0]
            first = torch.zeros(FIRST_MESSAGE, dtype=torch.long, device="cpu")  # gloo: always CPU
            first[: min(message.numel(), FIRST_MESSAGE)] = message[:FIRST_MESSAGE]
            self._broadcast(first, src)
            if message.numel() > FIRST_MESSAGE:
                self._broadcast(message[FIRST_MESSAGE:].clone(), src)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self._local is not None:
            self._local.broadcast_(tensor, 0)  # the shift group's first rank
        else:
            run_blocking(dist.broadcast, tensor, src=src, group=self._plan_group)

    def _receive(self) -> torch.Tensor | None:
        src = self.mesh.shift.ranks[0]
        first = torch.empty(FIRST_MESSAGE, dtype=torch.long, device="cpu")
        self._broadcast(first, src)
        if int(first[2]) == STOP_CHUNKS:
            return None
        size = HEADER + payload_size(first[:HEADER])
        if size <= FIRST_MESSAGE:
            return first[:size]
        rest = torch.empty(size - FIRST_MESSAGE, dtype=torch.long, device="cpu")
        self._broadcast(rest, src)
        return torch.cat((first, rest))

    def run_step(self, plan: StepPlan) -> torch.Tensor | None:
        """Run `plan` without sending it (every rank must pass the same plan, as in SPMD code);
        the sampled logits [samples, padded_vocab] on rank 0, None elsewhere."""
        return self._run(encode_plan(plan))

    def _run(self, message: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor | None:
        # decoded on the host: its sizes (`.tolist()`, `int()`, `nonzero`) never wait for the device,
        # which may still be running the previous step; then one pass of copies to the device
        _, mode, batch = decode_plan(
            message,
            self.tables,
            self.cache.block_size,
            pad_to_multiple=self.mesh.config.sp,
            sliding_window=self.model_config.sliding_window,
            inv_freq=self._inv_freq,
        )
        device = self.mesh.device
        where = (batch.token_ids == PENDING).nonzero().flatten()  # on the host: no read
        host = batch
        batch = batch.to(device)
        if where.numel():  # the previous step's draws, still on the device
            pending = self._share_pending(pending, where.numel())
            index = (where.to(device, non_blocking=True),)
            batch = replace(batch, token_ids=batch.token_ids.index_put(index, pending))
        if self.shift_model.graphs is not None:  # SP x TP decodes: padded to their graph's batch
            batch = self.shift_model.graphs.padded(batch, mode)
        if self.mesh.shift.size == 1:  # one rank owns every row and column
            return self.shift_model.forward(batch, mode, batch.sample_rows)
        # which rank computes and sends which logits: from the host's copy of the plan (no device read)
        vocab_per_tp = self.shift_model.vocab_per_tp
        tokens = batch.token_ids.shape[0]
        layout = logits_layout(host.sample_rows, host.sample_argmax, tokens, mode, self.mesh, vocab_per_tp)
        rows = layout.blocks[layout.me].hidden_rows
        rows = batch.sample_rows if mode is Mode.TP else rows.to(device, non_blocking=True)
        mine = self.shift_model.forward(batch, mode, rows)
        return gather_logits(mine, layout, self.mesh, vocab_per_tp, self.model_config.vocab_size)

    def _share_pending(self, pending: torch.Tensor | None, count: int) -> torch.Tensor:
        """Rank 0's pending tokens (the draws it has not read) on every rank's device: one broadcast
        of `count` ints, device to device (NCCL on GPUs), so no rank waits for the host."""
        device = self.mesh.device
        if pending is not None:
            pending = pending.to(device, non_blocking=True)
        if self.mesh.shift.size == 1:
            return pending
        tokens = pending if pending is not None else torch.empty(count, dtype=torch.long, device=device)
        if device.type == "cpu":
            self._broadcast(tokens, self.mesh.shift.ranks[0])
        else:
            dist.broadcast(tokens, src=self.mesh.shift.ranks[0], group=self.mesh.shift.pg)
        return tokens


def _prefill_over_block_0(
    cache: PagedKVCache, config: ModelConfig, mode: Mode = Mode.TP, sp: int = 1, tokens: int = 2
):
    """A made-up step for warm-ups: a prompt of `tokens` written from block 0 on, its last row sampled."""
    from shiftlm.serve.plan import ScheduledChunk

    blocks = tuple(range(-(-tokens // cache.block_size)))
    chunk = ScheduledChunk(0, (0,) * tokens, 0, blocks, True)
    tables = BlockTables(max_blocks_per_seq=len(blocks), device="cpu")
    return decode_plan(
        encode_plan(StepPlan(0, mode, (chunk,))), tables, cache.block_size, sp, config.sliding_window
    )[2]


def _warm_up_steps(shift_model: ShiftModel, graph_mode) -> list[tuple[Mode, FlatBatch, torch.Tensor]]:
    """(mode, made-up step, its hidden rows) for each mode `graph_mode` gives a graph of its own."""
    cache, config, mesh = shift_model.cache, shift_model.config, shift_model.mesh
    sp, steps = mesh.config.sp, []
    sizes = {Mode.TP: (2,), Mode.SP_TP: (sp, 2 * sp) if sp > 1 else (2,)}  # see CompiledMixed.warm_up
    for mode in (Mode.TP, Mode.SP_TP):
        for tokens in sizes[mode] if graph_mode(mode) is mode else ():
            batch = _prefill_over_block_0(cache, config, mode, sp, tokens)
            rows = batch.token_ids.shape[0]
            block = logits_block(batch.sample_rows, rows, mode, mesh.coords, sp, shift_model.vocab_per_tp)
            steps.append((mode, batch.to(mesh.device), block.hidden_rows.to(mesh.device)))
    return steps


def _blocks_from_memory(
    config: ModelConfig, mesh: Mesh, block_size: int, dtype: torch.dtype, utilization: float, activations: int
) -> int:
    """KV blocks this rank's GPU memory leaves (worker/kv_memory.py), the smallest over the group."""
    from shiftlm.serve.worker.kv_memory import blocks_for_memory, kv_bytes_per_block

    if mesh.device.type != "cuda":
        raise ConfigError("num_blocks=None sizes the KV cache from GPU memory: give a block count on the CPU")
    per_block = kv_bytes_per_block(config, mesh.config, block_size, dtype.itemsize)
    free, total = torch.cuda.mem_get_info(mesh.device)
    blocks = torch.tensor(
        [blocks_for_memory(free, total, utilization, activations, per_block)], device=mesh.device
    )
    if mesh.shift.size > 1:
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=mesh.shift.pg)
    return int(blocks.item())


def _attention_kernel(backend: str, device: torch.device):
    """The CPU paged-attention kernel module the backend asks for, or None (gather + SDPA)."""
    if backend in ("sdpa", "flex") or torch.device(device).type != "cpu":
        if backend == "cpu-kernel":
            raise ConfigError(f"--attention-backend cpu-kernel runs on CPU only, not on {device}: use auto")
        return None
    from shiftlm.kernels import cpu as cpu_kernels

    kernel = cpu_kernels.load()
    if kernel is None and backend == "cpu-kernel":
        raise ConfigError(
            "--attention-backend cpu-kernel: the kernel could not be built here (see the warning above); "
            "install a C++ compiler or use --attention-backend auto"
        )
    return kernel
