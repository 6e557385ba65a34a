"""The model runner: rank 0 broadcasts each step plan, every rank runs it, logits come back to rank 0.

    runner = ModelRunner.load(model_dir, mesh, num_blocks=256, block_size=16)
    if mesh.rank == 0:
        engine = Engine(runner, ...)          # runner.execute(plan) -> logits [samples, vocab]
        ...; runner.stop_workers()
    else:
        runner.serve_steps()                  # loops until rank 0 stops it

The plan is a few kilobytes of Python (token ids, positions via chunk starts, block tables, mode) and
goes out with `broadcast_object_list`; each rank then builds the same flat batch from it. Logits come
back with one `reduce` of the per-rank partials (each logit has exactly one owner rank).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from shiftlm.config import ModelConfig
from shiftlm.mesh import Mesh
from shiftlm.model import build_model
from shiftlm.model.sharding import kv_heads_of_block
from shiftlm.serve.paged_attention import PagedKVCache, flatten_plan
from shiftlm.serve.scheduler import StepPlan
from shiftlm.serve.shift_model import ShiftModel


class ModelRunner:
    """Executes step plans on every rank of one shift group (dp = pp = 1)."""

    def __init__(self, model_config: ModelConfig, shift_model: ShiftModel, mesh: Mesh):
        self.model_config = model_config
        self.shift_model = shift_model
        self.mesh = mesh
        self.cache = shift_model.cache

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        mesh: Mesh,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> ModelRunner:
        config = ModelConfig.from_hf(model_dir)
        model = build_model(config, mesh, checkpoint=model_dir, dtype=dtype).eval()
        p = mesh.config.sp * mesh.config.tp
        first, last = kv_heads_of_block(mesh.shard_index, p, config.num_kv_heads)
        cache = PagedKVCache(config.num_layers, num_blocks, block_size, last - first, config.head_dim, dtype)
        return cls(config, ShiftModel(model, mesh, cache), mesh)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Rank 0: run `plan` on all ranks; logits [plan.num_samples, vocab_size]."""
        self._broadcast(plan)
        return self._run(plan)[:, : self.model_config.vocab_size]

    def serve_steps(self) -> None:
        """Ranks > 0: run every plan rank 0 broadcasts, until it broadcasts None."""
        while (plan := self._broadcast(None)) is not None:
            self._run(plan)

    def stop_workers(self) -> None:
        self._broadcast(None)

    def _broadcast(self, plan: StepPlan | None) -> StepPlan | None:
        group = self.mesh.shift
        if group.size == 1:
            return plan
        box = [plan]
        dist.broadcast_object_list(box, src=group.ranks[0], group=group.pg)
        return box[0]

    def _run(self, plan: StepPlan) -> torch.Tensor:
        batch = flatten_plan(plan, self.cache.block_size, pad_to_multiple=self.mesh.config.sp)
        partial = self.shift_model.forward(batch, plan.mode)
        group = self.mesh.shift
        if group.size > 1:
            dist.reduce(partial, dst=group.ranks[0], group=group.pg)
        return partial
