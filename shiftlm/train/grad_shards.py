"""ZeRO-2/3 gradients held as shards (Rajbhandari et al. 2020, §5.2 P_g; the bucketed reduce-scatter
of DeepSpeed ZeRO-2 and FSDP, with per-unit buckets).

Between steps a rank holds only `shard`: the sum over the data group of its own 1/N of every sharding
unit (a decoder layer, the embedding, the final norm, the LM head; `flat.units`), laid out like the
Adam moments. During backward a unit's full-size gradient exists only transiently:
- autograd accumulates a parameter's gradient into `.grad` (a fresh tensor: there is no flat
  gradient buffer); its post-accumulate hook adds it into the unit's buffer (allocated on the unit's
  first gradient) and drops `.grad`. One buffer is open at a time: a gradient of another unit that
  lands early (the norms and biases a zero-bubble I pass produces before its W brings the unit's
  weights, which `model/deferred.accumulate_grad` hands to the same hooks) waits in its `.grad`;
- when every parameter of the unit has arrived, the unit's buffer is reduce-scattered over the data
  group, this rank's piece is added into `shard`, and the buffer is freed. `in_flight` (1) unit is
  reduced asynchronously (on gloo an in-place all-reduce, whose result is sliced) while the next one
  fills, overlapping the rest of backward; so at most two unit buffers exist at once.
- gradients no hook brings (BitPipe's replica sums, whose stages are not hooked: the executor's
  GRAD_SYNC reads their `.grad`) are handed over by `parameters_ready` (the executor's per-stage
  callback), a unit at a time; `finish()` reduces whatever is left.

Micro-batches: each micro-batch's backward reduces each unit once and accumulates into the shard
(DeepSpeed ZeRO-2's choice). The alternative, a unit buffer kept across micro-batches and reduced
after the last one, moves 1/A of the bytes but keeps every unit's full gradient alive from the first
micro-batch's backward to the last (without a pipeline, the whole model's; with 1F1B, the stage's for
nearly the whole step): no gradient memory saving with accumulation, which is what ZeRO-2 is for.
Every contribution is reduced exactly once, whatever the grouping, so the sum is the same up to
rounding; all ranks run the same backward and schedule, so they start the same reductions in the same
order, as collectives must.

The sums DP does not see (a tied embedding's copy on the last stage, rows replicated over TP) are
taken afterwards on the shards: a rank owns the same element range of every TP peer's buffer (the
layouts are identical) and of both tied copies (each is a unit of its own, of equal length).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from shiftlm.comm import CommGroup, all_gather, all_reduce, reduce_scatter
from shiftlm.comm.p2p import exchange
from shiftlm.train.flat import GRADS_TAG, FlatParameters, hook_arrivals


class ShardedGrads:
    def __init__(
        self,
        flat: FlatParameters,
        group: CommGroup,
        ranges: list[tuple[int, int]],
        hooked: list[bool] | None = None,
        in_flight: int = 1,
        unit_groups: list[CommGroup] | None = None,
    ):
        """`ranges`: this rank's [start, end) of every unit (`zero.owned_ranges`); `hooked[i]`: whether
        parameter i's gradient is taken from autograd's accumulate hook (False for parameters whose
        gradients other code sums first, e.g. BitPipe's replica sync; `parameters_ready` brings them)."""
        self.flat, self.group, self.ranges = flat, group, ranges
        # each unit's data group where they differ (routed experts over `edp`, train/moe.py)
        self.unit_groups = unit_groups if unit_groups is not None else [group] * len(flat.units)
        self.in_flight = max(1, in_flight)
        self.offsets, offset = [], 0  # where each unit's piece starts in `shard`
        for a, b in ranges:
            self.offsets.append(offset)
            offset += b - a
        with torch.profiler.record_function(GRADS_TAG):
            self.shard = torch.zeros(offset, dtype=torch.float32, device=flat.device)
        self.unit_params: list[list[int]] = [[] for _ in flat.units]
        for index, unit in enumerate(flat.unit_of):
            self.unit_params[unit].append(index)
        self._buffers: dict[int, torch.Tensor] = {}  # unit -> its full-size gradient (transient)
        self._arrivals: list[set[int]] = [set() for _ in flat.units]  # parameters in the open buffer
        self._pending: deque = deque()  # (unit, work, buffer, output) reductions in flight
        self.gloo = [g.size > 1 and dist.get_backend(g.pg) == "gloo" for g in self.unit_groups]
        self.reductions = 0  # unit reductions this step (a test reads it)
        hook_arrivals(flat, self._arrived, hooked)

    # -- the GradSync interface the trainer drives -------------------------------------------------
    def begin_step(self, micro_batches: int) -> None:
        self.reductions = 0

    @property
    def started_buckets(self) -> int:
        return self.reductions

    def parameters_ready(self, indices: list[int]) -> None:
        """Take these parameters' `.grad` (whatever code put there, e.g. BitPipe's replica sum) and
        reduce their units, one unit at a time."""
        for unit in sorted({self.flat.unit_of[index] for index in indices}):
            self._flush(unit)

    @torch.no_grad()
    def finish(self) -> None:
        """Every gradient of the step is in `shard` (summed over the group) when this returns."""
        for unit in range(len(self.flat.units)):
            self._flush(unit)
        while self._pending:
            self._complete()

    def zero(self) -> None:
        self.shard.zero_()
        for param in self.flat.parameters:
            param.grad = None

    # -- accumulation and reduction -----------------------------------------------------------------
    @torch.no_grad()
    def _take(self, index: int) -> bool:
        """Add parameter `index`'s `.grad` into its unit's buffer and drop it; False if it had none."""
        param = self.flat.parameters[index]
        if param.grad is None:
            return False
        unit = self.flat.unit_of[index]
        buffer = self._buffers.get(unit)
        if buffer is None:  # at most two unit buffers at once, open or in flight
            while self._pending and len(self._buffers) + len(self._pending) >= 2:
                self._complete()
            _, length = self.flat.units[unit]
            with torch.profiler.record_function(GRADS_TAG):
                buffer = torch.zeros(length, dtype=torch.float32, device=self.flat.device)
            self._buffers[unit] = buffer
        slot, (start, _) = self.flat.slots[index], self.flat.units[unit]
        buffer[slot.offset - start : slot.offset - start + slot.numel].add_(param.grad.reshape(-1))
        param.grad = None
        return True

    def _arrived(self, index: int) -> None:
        """A post-accumulate hook: parameter `index` has this micro-batch's gradient in `.grad`."""
        if self.flat.parameters[index].grad is None:  # a deferred weight's hook in the I pass: no gradient
            return
        unit = self.flat.unit_of[index]
        self._arrivals[unit].add(index)
        if len(self._arrivals[unit]) == len(self.unit_params[unit]):
            self._flush(unit)
        elif unit in self._buffers or not self._buffers:
            self._take(index)  # into the one open buffer; other units' early arrivals stay in `.grad`

    def _flush(self, unit: int) -> None:
        """Take every gradient of `unit` still in `.grad` and start the unit's reduction."""
        for index in self.unit_params[unit]:
            self._take(index)
        if unit in self._buffers:
            self._reduce(unit)

    @torch.no_grad()
    def _reduce(self, unit: int) -> None:
        """Start reducing `unit`'s buffer (it leaves `_buffers`; the next gradient opens a new one)."""
        buffer = self._buffers.pop(unit)
        self._arrivals[unit] = set()
        self.reductions += 1
        group = self.unit_groups[unit]
        if group.size == 1:
            self._pending.append((unit, None, buffer, buffer))
        elif self.gloo[unit]:  # gloo has no reduce-scatter: an in-place all-reduce, then this rank's slice
            work = all_reduce(buffer, group, async_op=True, in_place=True)
            self._pending.append((unit, work, buffer, None))
        else:
            with torch.profiler.record_function(GRADS_TAG):
                self._pending.append((unit, None, None, reduce_scatter(buffer, group, 0)))
        while len(self._pending) > self.in_flight:
            self._complete()

    def _complete(self) -> None:
        unit, work, buffer, output = self._pending.popleft()
        if work is not None:
            work.wait()
            group = self.unit_groups[unit]
            output = buffer.chunk(group.size)[group.rank]
        start = self.offsets[unit]
        self.shard[start : start + output.numel()].add_(output)
        if buffer is not None:  # free it now: gloo's finished work may keep a reference for a while
            buffer.untyped_storage().resize_(0)

    # -- the sums DP does not see, on the shards ------------------------------------------------------
    def pieces(self, index: int) -> list[tuple[int, int, int]]:
        """(start in `shard`, start in the parameter (flattened), length) of parameter `index`'s
        elements that this rank owns."""
        slot = self.flat.slots[index]
        unit = self.flat.unit_of[index]
        a, b = self.ranges[unit]
        start, end = max(a, slot.offset), min(b, slot.offset + slot.numel)
        if start >= end:
            return []
        return [(self.offsets[unit] + start - a, start - slot.offset, end - start)]

    @torch.no_grad()
    def sync_tp_replicated(self, owned: list[tuple[torch.nn.Module, str]], tp: CommGroup) -> None:
        """`model/grads.sync_tp_replicated_grads` on the shard: norm weights under Megatron sequence
        parallelism are summed over TP, KV rows replicated over TP over their holders.
        `owned[i]`: (stage, name in that stage) of flat parameter i."""
        if tp.size == 1:
            return
        from shiftlm.model.sharding import shard_spec, tp_partial_grad

        norms = []
        for index, (stage, name) in enumerate(owned):
            spec = shard_spec(name, stage.config, tp.rank, tp.size)
            pieces = self.pieces(index)
            if spec.dim is None:
                if stage.sequence_parallel or tp_partial_grad(name):
                    norms += pieces
                continue
            replicas = [r for r in range(tp.size) if shard_spec(name, stage.config, r, tp.size) == spec]
            if len(replicas) > 1:
                for start, _, length in pieces:
                    view = self.shard[start : start + length]
                    view.copy_(all_gather(view.unsqueeze(0), tp, dim=0)[replicas].sum(dim=0))
        if norms:  # one all-reduce for all of them
            summed = all_reduce(torch.cat([self.shard[s : s + n] for s, _, n in norms]), tp)
            offset = 0
            for start, _, length in norms:
                self.shard[start : start + length].copy_(summed[offset : offset + length])
                offset += length

    @torch.no_grad()
    def sync_tied(self, copies: list[int], pp: CommGroup, device: torch.device) -> None:
        """`pipeline/tied.sync_tied_embedding_grads` on the shard: `copies` are this rank's flat indices
        of the tied embedding's copies (each a unit of its own, so every holder owns the same element
        range); the pieces are summed in pp-rank order on every holder. Collective over pp."""
        holds = all_gather(torch.tensor([int(len(copies) > 0)], device=device), pp, dim=0)
        if not copies:
            return
        views = []
        for index in copies:
            unit = self.flat.unit_of[index]
            if len(self.unit_params[unit]) != 1:
                raise RuntimeError(
                    f"tied copy {self.flat.slots[index].name} must be a sharding unit of its own"
                )
            a, b = self.ranges[unit]
            views.append(self.shard[self.offsets[unit] : self.offsets[unit] + b - a])
        mine = views[0].clone()
        for view in views[1:]:
            mine += view
        peers = [r for r, held in zip(pp.ranks, holds.tolist()) if held and r != pp.global_rank]
        parts = {pp.global_rank: mine, **{peer: torch.empty_like(mine) for peer in peers}}
        # every holder sends to every other at once: one group (`pipeline/tied.py` does the same)
        handles = exchange([(mine, peer) for peer in peers], [(parts[peer], peer) for peer in peers], pp)
        for handle in handles:
            handle.wait()
        total = torch.stack([parts[rank] for rank in sorted(parts)]).sum(dim=0)
        for view in views:
            view.copy_(total)
