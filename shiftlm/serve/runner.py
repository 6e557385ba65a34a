"""The model runner: rank 0 broadcasts each step plan, every rank runs it, logits come back to rank 0.

    runner = ModelRunner.load(model_dir, mesh, num_blocks=256, block_size=16)
    if mesh.rank == 0:
        engine = Engine(runner, ...)          # runner.execute(plan) -> logits [samples, vocab]
        ...; runner.stop_workers()
    else:
        runner.serve_steps()                  # loops until rank 0 stops it

The plan is a few kilobytes of Python (token ids, positions via chunk starts, block tables, mode) and
goes out with `broadcast_object_list`; each rank then builds the same flat batch from it. Logits come
back with one `gather` of the block each rank owns (`logits.py`).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from shiftlm.config import ModelConfig
from shiftlm.mesh import Mesh
from shiftlm.model import build_model
from shiftlm.model.sharding import kv_heads_of_block
from shiftlm.serve.logits import gather_logits
from shiftlm.serve.paged_attention import PagedKVCache, flatten_plan
from shiftlm.serve.scheduler import StepPlan
from shiftlm.serve.shift_model import ShiftModel

# Ranks > 0 block in the plan broadcast while the server idles. Groups made by `Mesh` carry gloo's
# default timeout (30 minutes), after which an idle worker would die, so plans get a group of their own.
PLAN_WAIT_TIMEOUT = datetime.timedelta(days=7)


class ModelRunner:
    """Executes step plans on every rank of one shift group (dp = pp = 1)."""

    def __init__(self, model_config: ModelConfig, shift_model: ShiftModel, mesh: Mesh):
        self.model_config = model_config
        self.shift_model = shift_model
        self.mesh = mesh
        self.cache = shift_model.cache
        group = mesh.shift
        # new_group is collective: every rank builds the runner, in the same order
        self._plan_group = (
            dist.new_group(list(group.ranks), timeout=PLAN_WAIT_TIMEOUT) if group.size > 1 else None
        )

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
        return self.run_step(plan)[:, : self.model_config.vocab_size]

    def serve_steps(self) -> None:
        """Ranks > 0: run every plan rank 0 broadcasts, until it broadcasts None."""
        while (plan := self._broadcast(None)) is not None:
            self.run_step(plan)

    def stop_workers(self) -> None:
        self._broadcast(None)

    def _broadcast(self, plan: StepPlan | None) -> StepPlan | None:
        if self._plan_group is None:
            return plan
        box = [plan]
        dist.broadcast_object_list(box, src=self.mesh.shift.ranks[0], group=self._plan_group)
        return box[0]

    def run_step(self, plan: StepPlan) -> torch.Tensor | None:
        """Run `plan` without broadcasting it (every rank must pass the same plan, as in SPMD code);
        the sampled logits [samples, padded_vocab] on rank 0, None elsewhere."""
        batch = flatten_plan(plan, self.cache.block_size, pad_to_multiple=self.mesh.config.sp)
        mine = self.shift_model.forward(batch, plan.mode)
        return gather_logits(mine, batch, plan.mode, self.mesh, self.shift_model.vocab_per_tp)
