"""The training loop on any DP x PP x SP x TP layout.

    cfg = load_config("plan.toml", ["--train.steps=50"])
    result = train(cfg)        # on every rank, torch.distributed initialised (or a world of one)

One optimizer step: read this DP rank's micro-batches, count the target tokens of the *global*
batch, run forward/backward (`StepRunner`, directly or through the pipeline executor) with every
micro-batch's loss divided by that count, so the loss is normalised exactly once whatever the layout
or accumulation; sum gradients over the data group (bucketed, each bucket started as soon as its
gradients are final: from autograd hooks, or from the pipeline executor's per-stage callback), then
over the copies DP does not cover (a tied embedding's head copy on the last stage, KV rows replicated
over TP), clip by the global norm, AdamW with ZeRO-1, log. Checkpoints are layout-free and resume
bit-exactly into the same layout.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shiftlm.comm import all_reduce, tree_all_reduce
from shiftlm.hardware import device_peak_flops
from shiftlm.mesh import Mesh, choose_device, device_name
from shiftlm.model.grads import sync_tp_replicated_grads
from shiftlm.model.moe import SparseMoE
from shiftlm.model.sharding import is_expert_param, shard_spec
from shiftlm.model.weights import shard_group, source_name
from shiftlm.monitor import Watchdog, connect_store, faults
from shiftlm.monitor.live import straggler_watch
from shiftlm.pipeline.tied import sync_tied_embedding_grads, tied_embedding_copies
from shiftlm.train.config import TrainConfig
from shiftlm.train.data import BatchPlan, BatchReader, TokenDataset, split_holdout
from shiftlm.train.deterministic import CanonicalNorm
from shiftlm.train.flat import FlatParameters
from shiftlm.train.grad_shards import ShardedGrads
from shiftlm.train.grad_sync import GradSync
from shiftlm.train.metrics import RunLog, StepRecord, peak_memory_gb, throughput
from shiftlm.train.moe import unit_groups, unit_labels_with_experts
from shiftlm.train.optim import clip_coefficient, learning_rate
from shiftlm.train.pipeline import StageKey, stage_keys
from shiftlm.train.run_checkpoints import RunCheckpoints, flat_name
from shiftlm.train.setup import check_layout, resolve_inputs
from shiftlm.train.step import StepRunner, build_stages
from shiftlm.train.stopping import StepBoundary
from shiftlm.train.zero import ShardedAdamW, global_grad_norm
from shiftlm.train.zero3 import unit_labels


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> global mean loss
    last_step: int = 0
    checkpoint: Path | None = None  # the newest checkpoint (written by this run, or found complete)
    resumed_from: Path | None = None
    already_complete: bool = False  # the newest checkpoint had reached train.steps: nothing to do
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> held-out loss
    metrics: Path | None = None  # rank 0: metrics.jsonl
    loss_plot: Path | None = None  # rank 0: loss.png
    interrupted: int = 0  # the signal (SIGINT/SIGTERM) that stopped the run at a step boundary, else 0

    def summary(self) -> dict:
        """What `shiftlm train --json` prints (paths as strings)."""
        return {
            "steps": self.last_step,
            "losses": self.losses,
            "val_losses": self.val_losses,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "already_complete": self.already_complete,
            "metrics": str(self.metrics) if self.metrics else None,
            "loss_plot": str(self.loss_plot) if self.loss_plot else None,
            "interrupted": self.interrupted,
        }


class Trainer(RunCheckpoints):
    def __init__(self, config: TrainConfig, quiet: bool = False):
        self.config = config
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.inputs = resolve_inputs(config)
        parallel = check_layout(config, self.inputs.model, world)
        self.mesh = Mesh(parallel, device=choose_device(config.train.device)[0])
        self.stage_keys = stage_keys(config, self.mesh)
        self.stages = build_stages(self.inputs.model, self.mesh, config, self.inputs.init_checkpoint)
        # this rank's stages per model replica (BitPipe has two; replica 0 is the copy that is saved)
        self.replicas = [
            [s for s, (_, r) in zip(self.stages, self.stage_keys) if r == replica]
            for replica in sorted({r for _, r in self.stage_keys})
        ]
        owned = [
            (key, stage, name, param)
            for key, stage in zip(self.stage_keys, self.stages)
            for name, param in stage.named_parameters()
        ]
        self._indices_of: dict[StageKey, list[int]] = {}
        for index, (key, *_) in enumerate(owned):
            self._indices_of.setdefault(key, []).append(index)
        data_group = self.mesh.dp_sp  # ranks holding the same weights: DP replicas and Ulysses peers
        named = [(flat_name(name, key[1]), param) for key, _, name, param in owned]
        # ZeRO-2/3 with more than one rank: sharded gradients (`grad_shards.py`), cut per layer as at 3
        self.sharded_grads = config.train.zero >= 2 and data_group.size > 1
        names = [name for name, _ in named]
        units = unit_labels(names) if config.train.zero >= 2 else None
        # ep > 1 or etp != tp: routed experts are units of their own, summed and sharded over `edp`
        # (train/moe.py); edp divides dp_sp (`ParallelConfig.check_experts`), so one padding serves both
        units = unit_labels_with_experts(names, units, parallel.experts_apart)
        self.flat = FlatParameters(
            named, pad_to=data_group.size, units=units, full_grads=not self.sharded_grads
        )
        groups = unit_groups(self.flat, self.mesh) if parallel.experts_apart else None
        overlap = config.train.overlap_grad_sync
        if not self.sharded_grads:
            bucket_bytes = int(config.train.bucket_mb * 2**20)
            self.grad_sync = GradSync(
                self.flat,
                data_group,
                bucket_bytes,
                overlap,
                count_accumulations=config.parallel.pp == 1,
                groups=[groups[u] for u in self.flat.unit_of] if groups else None,
                deterministic=config.train.deterministic,
            )
        decay = lambda name, shape: len(shape) >= 2  # noqa: E731 (no decay on norms and biases)
        self.optimizer = ShardedAdamW(
            self.flat, data_group, config.optim, decay, stage=config.train.zero, unit_groups=groups
        )
        self.optimizer.shard_parameters(self.stages)  # ZeRO-3 only: shards at rest, gathered per layer
        self.norm_mask, self.expert_norm = self._norm_mask(owned)
        self.canonical_norm = None
        if config.train.deterministic:  # train/deterministic.py: every sum in one order at any ep
            self.canonical_norm = CanonicalNorm(self.flat, self._counted, self.mesh)
            self._moe_layers = [
                m for stage in self.stages for m in stage.modules() if isinstance(m, SparseMoE)
            ]
            for module in self._moe_layers:
                module.deterministic = True
        validation = config.validation
        holdout = validation.steps * config.train.global_batch if validation.freq else 0
        dataset, held_out = split_holdout(self._dataset(), holdout)
        self.dataset_samples = len(dataset)
        plan = BatchPlan(config.train.global_batch, config.train.micro_batch, config.parallel.dp)
        self.reader = BatchReader(dataset, plan, self.mesh.coords.dp, config.train.seed)
        self.val_reader = (
            BatchReader(held_out, plan, self.mesh.coords.dp, config.train.seed) if holdout else None
        )
        self.runner = StepRunner(
            self.stages,
            self.mesh,
            config,
            self._stage_grads_ready if overlap or self.sharded_grads else None,
        )
        if self.sharded_grads:  # BitPipe's replica sums read `.grad`: those stages hand over when ready
            pipeline = self.runner.pipeline
            self._synced = set(pipeline.executor.synced_stages) if pipeline else set()
            hooked = [key not in self._synced for key, *_ in owned]
            self.grad_sync = ShardedGrads(
                self.flat, data_group, self.optimizer.ranges, hooked, unit_groups=groups
            )
            self.optimizer.grad_shard = self.grad_sync.shard
            self._owned_names = [(stage, name) for _, stage, name, _ in owned]
            index_of = {id(param): index for index, (*_, param) in enumerate(owned)}
            self._tied_copies = [
                [index_of[id(p)] for p in tied_embedding_copies(stages)] for stages in self.replicas
            ]
        self.checkpoints = Path(config.log.dir) / "checkpoints"
        self.start_step = 0
        self.resumed_from: Path | None = None
        self.log = (
            RunLog(Path(config.log.dir), config.train.steps, config.log.progress, quiet)
            if self.mesh.rank == 0
            else None
        )

    def _dataset(self):
        """Token windows from the shards, or multi-stream samples (`data.format = "streams"`)."""
        config = self.config
        if config.data.format == "streams":
            from shiftlm.train.streams import StreamSamples
            from shiftlm.train.tokenizer import read_tokenizer_json

            tokenizer = read_tokenizer_json(self.inputs.tokenizer_dir)
            return StreamSamples(config.data.source, tokenizer, config.train.seq_len)
        return TokenDataset(self.inputs.shards, config.train.seq_len)

    def _norm_mask(self, owned: list) -> tuple[torch.Tensor, tuple | None]:
        """Count each element of the whole model once: replica 0 only (BitPipe), the embedding and not
        a tied head's copy of it, TP-replicated tensors (norms, shared KV heads) on their first holder.
        With ep > 1 (or etp != tp) the routed experts get a mask of their own (`global_grad_norm`):
        summed over ep (and etp when it is not tp, then counted on tp rank 0 only, since the tp sum
        that follows would count it TP times)."""
        counted = set()
        mesh = self.mesh
        for (_, replica), stage, name, _ in owned:
            source = source_name(stage, name)
            group = shard_group(mesh, source)
            mine = shard_spec(source, stage.config, group.rank, group.size)
            holders = [
                r for r in range(group.size) if shard_spec(source, stage.config, r, group.size) == mine
            ]
            if replica == 0 and source == name and group.rank == holders[0]:
                counted.add(flat_name(name, replica))
        self._counted = counted
        ranges = self.optimizer.ranges if self.sharded_grads else None  # shard-sized when sharded
        if not mesh.config.experts_apart:
            return self.flat.mask(lambda name, shape: name in counted, ranges), None
        dense = self.flat.mask(lambda name, shape: name in counted and not is_expert_param(name), ranges)
        experts = self.flat.mask(lambda name, shape: name in counted and is_expert_param(name), ranges)
        if mesh.etp is mesh.tp:
            return dense, (experts, [mesh.ep], 1.0)
        return dense, (experts, [mesh.ep, mesh.etp], float(mesh.tp.rank == 0))

    def _stage_grads_ready(self, key: StageKey) -> None:
        """The pipeline executor's callback: this stage's gradients are final, start its buckets."""
        indices = self._indices_of[key]
        self.flat.adopt_grads(indices)
        self.grad_sync.parameters_ready(indices)

    def _sum_grads(self) -> None:
        """Sum every gradient over all ranks and copies that hold its parameter.

        First the data group (its buckets may have started during backward), then the copies DP
        does not see: a tied embedding's head copy on the last stage (per model replica), and KV
        rows replicated over TP. All three are sums, so the order does not change the result beyond
        rounding; it is fixed, so the overlapped and non-overlapped paths agree bit for bit.
        With sharded gradients (ZeRO-2/3) the data group's reductions ran during backward and the
        other two sums are taken on the shards."""
        if self.sharded_grads:
            self.grad_sync.finish()
            if self.stages[0].config.tie_word_embeddings and self.mesh.pp.size > 1:
                for copies in self._tied_copies:
                    self.grad_sync.sync_tied(copies, self.mesh.pp, self.mesh.device)
            self.grad_sync.sync_tp_replicated(self._owned_names, self.mesh.tp)
            return
        self.flat.adopt_grads()
        if self.canonical_norm is not None:  # the expert weights' per-source gradients, by the tree
            for module in self._moe_layers:
                module.source_grads.flush()
        self.grad_sync.finish()
        for stages in self.replicas:
            sync_tied_embedding_grads(stages, self.mesh)
        for stage in self.stages:
            sync_tp_replicated_grads(stage)

    # -- the loop ----------------------------------------------------------------------------------

    def run(self, stop_after: int | None = None) -> TrainResult:
        watchdog = self._start_watchdog()
        self.stragglers = straggler_watch(self.config, self.mesh, Path(self.config.log.dir) / "ledgers")
        fault = faults.inject_from_env()
        # SIGINT/SIGTERM end the run at the next step boundary, with a checkpoint (train/stopping.py)
        stuck_s = self.config.monitor.watchdog_s if watchdog is not None else 0.0
        self.boundary = StepBoundary(self.config.checkpoint.every_s, self.mesh.device, stuck_s)
        try:
            with self.boundary:
                return self._run(stop_after)
        finally:
            if fault is not None:
                faults.remove(fault)
            if watchdog is not None:
                watchdog.stop()

    def _start_watchdog(self) -> Watchdog | None:
        """C4-style hang detection: heartbeats in the job's store, a thread that names the stuck rank."""
        seconds = self.config.monitor.watchdog_s
        if seconds <= 0 or self.mesh.world_size == 1 or "MASTER_ADDR" not in os.environ:
            return None
        dump_dir = Path(self.config.log.dir) / "ledgers"
        return Watchdog(
            connect_store(), self.mesh.rank, self.mesh.world_size, seconds, dump_dir=dump_dir
        ).start()

    def _run(self, stop_after: int | None) -> TrainResult:
        cfg = self.config.train
        result = TrainResult(last_step=self.start_step, resumed_from=self.resumed_from)
        if self.resumed_from is not None and self.start_step >= cfg.steps:
            result.already_complete, result.checkpoint = True, self.resumed_from
        elif self.resumed_from is not None and self.log is not None and not self.log.quiet:
            print(f"resumed from step {self.start_step} ({self.resumed_from})", flush=True)
        device = self.mesh.device
        peak = self.config.log.peak_tflops * 1e12 or device_peak_flops(
            device_name(device), "bf16" if self.runner.autocast_dtype else "fp32"
        )
        started = time.perf_counter()
        for step in range(self.start_step, cfg.steps):
            faults.set_step(step + 1)
            tick = time.perf_counter()
            loss, grad_norm, lr = self.step(step, self.reader.step(step))
            result.losses[step + 1] = loss
            result.last_step = step + 1
            freq = self.config.validation.freq
            val_loss = None
            if self.val_reader is not None and ((step + 1) % freq == 0 or step + 1 == cfg.steps):
                val_loss = result.val_losses[step + 1] = self.validation_loss()
            elapsed = time.perf_counter() - tick
            if self.log is not None:
                tokens_per_s, achieved, mfu = throughput(
                    self.inputs.model, cfg.seq_len, cfg.global_batch, elapsed, self.mesh.world_size, peak
                )
                done = step + 1 - self.start_step
                self.log.step(
                    StepRecord(
                        step=step + 1,
                        loss=loss,
                        lr=lr,
                        grad_norm=grad_norm,
                        tokens_per_s=tokens_per_s,
                        tflops_per_device=achieved / 1e12,
                        mfu=mfu,
                        memory_gb=peak_memory_gb(device),
                        step_time_s=elapsed,
                        eta_s=(time.perf_counter() - started) / done * (cfg.steps - step - 1),
                        val_loss=val_loss,
                    ),
                    self.start_step + 1,
                )
            every = self.config.checkpoint.every
            signum, due = self.boundary.check()  # a signal or a timed checkpoint: every rank agrees
            saved = self.config.checkpoint.enable and (
                (every and (step + 1) % every == 0) or step + 1 == cfg.steps or due or signum
            )
            if saved:
                result.checkpoint = self.save(step + 1)
                self.boundary.saved()
            if signum:
                result.interrupted = signum
                break
            exclude = self.stragglers.after_step(step + 1, elapsed) if self.stragglers else None
            if exclude is not None:  # --elastic: relaunch without a persistently slow rank
                if not saved and self.config.checkpoint.enable:
                    self.save(step + 1)
                raise exclude
            if stop_after is not None and step + 1 >= stop_after:
                break
        if self.stragglers is not None:  # the last window, so `shiftlm monitor report RUN` sees it
            self.stragglers.after_step(result.last_step, 0.0, final=True)
        if self.log is not None:
            result.loss_plot = self.log.finish()
            result.metrics = self.log.metrics_file if self.log.metrics_file.is_file() else None
        return result

    def step(self, step: int, micro_batches: list) -> tuple[float, float, float]:
        """One optimizer step (`step` counts from 0) on this DP rank's `micro_batches`: forward and
        backward, gradient sums, clipping, AdamW. Returns the global mean loss, the gradient norm and
        the learning rate. (bench/gpu_train.py times it on batches of its own.)"""
        self._zero_grad()
        target_tokens = self._global_target_tokens(micro_batches)
        self.grad_sync.begin_step(len(micro_batches))
        loss = self.runner.run(micro_batches, target_tokens)
        self._sum_grads()
        if self.canonical_norm is not None:
            grad_norm = self.canonical_norm()
        else:
            grad_norm = global_grad_norm(
                self.flat, self.norm_mask, [self.mesh.tp, self.mesh.pp], self.optimizer, self.expert_norm
            )
        lr = learning_rate(step, self.config.train.steps, self.config.optim)
        self.optimizer.step(lr, clip_coefficient(grad_norm, self.config.optim.grad_clip))
        # the loss lives on the last stage, split over the data group: sum it to every rank
        data_sum = tree_all_reduce if self.canonical_norm is not None else all_reduce
        loss = all_reduce(data_sum(loss.reshape(1), self.mesh.dp_sp), self.mesh.pp).item()
        return loss, grad_norm, lr

    def validation_loss(self) -> float:
        """Mean loss over the held-out batches (the same ones every time), computed by the training
        step's own forward/backward on every layout, with the gradients dropped and no optimizer step."""
        total = 0.0
        steps = self.config.validation.steps
        for index in range(steps):
            self._zero_grad()
            micro_batches = self.val_reader.step(index)
            self.grad_sync.begin_step(len(micro_batches))
            loss = self.runner.run(micro_batches, self._global_target_tokens(micro_batches))
            self._sum_grads()  # drains the buckets the backward started (same collectives on every rank)
            total += all_reduce(all_reduce(loss.reshape(1), self.mesh.dp_sp), self.mesh.pp).item()
        self._zero_grad()
        return total / steps

    def _zero_grad(self) -> None:
        if self.sharded_grads:
            self.grad_sync.zero()
        else:
            self.flat.zero_grad()

    def _global_target_tokens(self, micro_batches) -> int:
        """Target tokens (not -100) in the whole global batch: this DP rank's, summed over DP."""
        local = sum(int((batch[1] != -100).sum()) for batch in micro_batches)
        total = torch.tensor([local], dtype=torch.float64, device=self.mesh.device)
        return int(all_reduce(total, self.mesh.dp).item())


def train(config: TrainConfig, stop_after: int | None = None, quiet: bool = False) -> TrainResult:
    """Train per `config` on this process's rank (resuming from the newest checkpoint if asked)."""
    trainer = Trainer(config, quiet=quiet)
    trainer.prepare_run_dir()
    trainer.maybe_resume()
    result = trainer.run(stop_after)
    trainer.mesh.close()  # after a failure the process ends; a finished run may be one of many in it
    return result
