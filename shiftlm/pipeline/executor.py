"""The one executor: run any (lowered) schedule on torch.distributed, one rank of the pp group.

    ex = PipelineExecutor(schedule, stages={0: stage0, 7: stage7}, rank=pp_rank, pp_group=group,
                          pp_ranks=[0, 1, 2, 3], loss_fn=lambda out, target: mse(out, target) / m)
    loss = ex.step(microbatch_inputs, targets)   # summed loss where a last stage lives, else None

Stages take one tensor and return one tensor. Shapes travel with the data on the first step: every
forward send is preceded by a fixed-size header (dtype code and shape), so stages may change the
activation shape. The receiver keeps what it learned, and later steps send no headers (as PyTorch's
stages infer shapes once): every step must then give each micro-batch the shapes of the first step,
which the sender checks (`reset_shapes()` on every rank starts over). A backward send has the shape
of the activation it answers, which the receiver already knows.

Communication is `shiftlm.comm` `isend` / `irecv` (counted, and in the collective ledger when it is on)
with one tag per message (gloo's batch_isend_irecv hangs). For every pair of ranks the two sides post
their operations in one order, fixed from the schedule (`p2p_order.pair_orders`): NCCL matches by that
order, gloo by tag, so the same code is right on both. A send is posted when its action runs and never
blocks (waited at the end of the step); every receive is posted as early as that order allows (once
all earlier operations of the pair are posted), so a message lands while the rank computes and a rank
only waits at the RECV right before the action that needs it: a schedule that validates cannot
deadlock here.
Per action the executor does only what the action needs: the peer, tag and method of every action
are resolved once, at construction, and backward passes accumulate into `.grad` through autograd's
own in-place accumulation (`torch.autograd.backward(..., inputs=...)`), not a copy per micro-batch.

Backward split (Qi et al. 2023, Sec. 2): I walks the stage's graph once, with weight gradients
deferred (`shiftlm.model.deferred`): it computes the gradient w.r.t. the stage input and the
gradients of parameters that no deferrable linear owns (norms, embeddings), queues every deferrable
linear's dA = dY^T X GEMM, and frees the graph; W runs that queue into .grad. B does both at once.
A stage without deferrable linears gets all its gradients in I, and its W does nothing.
BitPipe's GRAD_SYNC sums a stage's gradients with the other replica's copy (on the mirrored rank,
or this rank) as soon as that chunk's backwards are done; both copies then hold the full gradient.
`on_stage_grads_ready(key)` (optional) is called with a (stage, replica) key as soon as that stage's
gradients for the step are final: after its last B, I or W, or, where the schedule syncs replicas,
once the GRAD_SYNC sum has landed (at the end of the step). A trainer starts the stage's data-parallel
all-reduce there, overlapping it with the rest of the schedule (as DDP's hooks do without a pipeline).
Only the pp group and pp peer ranks are used, so TP/SP/DP groups around the executor compose
unchanged (tested with the Transformer at pp 2 x tp 2 and pp 2 x sp 2).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from shiftlm.comm import CommGroup
from shiftlm.model.deferred import WeightGradStore
from shiftlm.model.ops import DEFERRABLE, PLAIN
from shiftlm.pipeline.actions import COMM_KINDS, Action, Kind, Schedule, split_keys
from shiftlm.pipeline.lowering import lower
from shiftlm.pipeline.messaging import PairMessaging, shape_header
from shiftlm.pipeline.p2p_order import awaited_by, rank_operations, sent_by


class PipelineExecutor(PairMessaging):
    """Runs this rank's actions of `schedule`; `stages` maps stage (or (stage, replica)) to a module."""

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int | tuple[int, int], torch.nn.Module],
        rank: int,
        pp_group: CommGroup | dist.ProcessGroup | None = None,
        pp_ranks: Sequence[int] | None = None,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
        on_stage_grads_ready: Callable[[tuple[int, int]], None] | None = None,
        device: torch.device | str | None = None,
        shm_p2p: bool | None = None,
    ):
        """`device`: where received activations, gradients and shape headers are allocated (the
        stages' device; NCCL moves CUDA tensors only); None is torch's default device.
        `shm_p2p`: send the pipeline's messages through shared memory (`comm/shm_p2p.py`) where every
        pp rank is on this host; None (default) does so for CPU stages on gloo. With it on, the
        constructor is collective over the pp group (every pp rank constructs its executor)."""
        self.device = device
        self.schedule = lower(schedule)
        self.rank = rank
        self.pp_ranks = list(pp_ranks) if pp_ranks is not None else list(range(schedule.pp))
        self.group = _as_comm_group(pp_group, self.pp_ranks)
        self.loss_fn = loss_fn
        self.modules = {(k, 0) if isinstance(k, int) else tuple(k): m for k, m in stages.items()}
        expected = set(schedule.placement.stages_of(rank))
        if set(self.modules) != expected:
            raise ValueError(
                f"rank {rank} must hold stages (stage, replica) {sorted(expected)}, got {sorted(self.modules)}"
            )
        self.on_stage_grads_ready = on_stage_grads_ready
        actions = self.schedule.ranks[rank]
        # stages whose gradients are final only once the replicas' GRAD_SYNC lands (end of step)
        # forwards whose backward is split (I + W) build deferrable linears; the others autograd's own.
        # The choice reaches a stage whose forward takes `ops` (model/ops.py); other modules (tests'
        # toy stages) run the linears they were built with
        self._split = split_keys(actions)
        self._takes_ops = {
            k for k, m in self.modules.items() if "ops" in inspect.signature(m.forward).parameters
        }
        self._synced = sorted({(a.stage, a.replica) for a in actions if a.kind is Kind.GRAD_SYNC})
        last = {(a.stage, a.replica): i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.I, Kind.W)}
        ready_after = {index: key for key, index in last.items() if key not in self._synced}
        # the program: (method, action, stage key whose grads are final after it, or None), resolved once
        self._program = [
            (getattr(self, f"_run_{a.kind.value.lower()}"), a, ready_after.get(i))
            for i, a in enumerate(actions)
        ]
        # per peer pipeline rank: this rank's sends to it and receives from it, in the pair's order
        self._pair_ops = rank_operations(self.schedule, rank)
        self._op_index = {
            m: i for operations in self._pair_ops.values() for i, (_, m) in enumerate(operations)
        }
        self._messages = {
            a: sent_by(a, self.schedule, rank) or awaited_by(a, self.schedule, rank)
            for a in actions
            if a.kind in COMM_KINDS or a.kind is Kind.GRAD_SYNC
        }
        self._shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}  # received activations
        self._sent_shapes: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}  # receive buffers, kept across steps
        self._sync_buffers: dict[tuple[int, int], torch.Tensor] = {}  # BitPipe: the other copy's sums
        self._params_of = {
            key: [p for p in module.parameters() if p.requires_grad] for key, module in self.modules.items()
        }
        self._shm = shared_memory_p2p(self.group, device, shm_p2p)

    @property
    def synced_stages(self) -> list[tuple[int, int]]:
        """(stage, replica) keys whose gradients the schedule sums across replicas (BitPipe)."""
        return list(self._synced)

    def reset_shapes(self) -> None:
        """Forget the activation shapes: the next step sends headers again (call it on every rank)."""
        self._shapes.clear(), self._sent_shapes.clear(), self._buffers.clear()

    # -- the step --------------------------------------------------------------------------------
    def step(self, microbatch_inputs: Sequence[torch.Tensor], targets: Sequence[Any]) -> torch.Tensor | None:
        """Run one training step; accumulate parameter .grad; return the summed loss of this rank's
        last stage(s) (None where no last stage lives; BitPipe has one per replica)."""
        self._sends: list = []
        self._weight_grads = WeightGradStore()  # the I pass's queued weight GEMMs, by (stage, mb, replica)
        self._inputs: dict[tuple, torch.Tensor] = {}
        self._outputs: dict[tuple, torch.Tensor] = {}
        self._grads: dict[tuple, torch.Tensor] = {}  # gradient w.r.t. a stage's output
        self._handoff: dict[tuple, torch.Tensor] = {}  # same-rank stage-to-stage activations
        self._input_grads: dict[tuple, torch.Tensor] = {}
        self._recvs: dict[tuple, Any] = {}
        self._out_shapes: dict[tuple, tuple] = {}  # outputs whose gradient comes back from another rank
        self._local_synced: set[tuple[int, int]] = set()
        self._loss: torch.Tensor | None = None
        self._data, self._targets = microbatch_inputs, targets
        self._sync_recvs: list = []
        self._cursor = dict.fromkeys(self._pair_ops, 0)
        for peer in self._pair_ops:
            self._advance(peer)
        ready, shm = self.on_stage_grads_ready, self._shm
        for run, action, ready_key in self._program:
            run(action)
            if ready_key is not None and ready is not None:
                ready(ready_key)
            if shm is not None and shm.pending:  # move what waits (a send larger than the ring's room)
                shm.poll()
        for peer, operations in self._pair_ops.items():  # what is left: gradient sums to receive
            if self._cursor[peer] < len(operations):
                self._advance(peer, through=operations[-1][1])
        for work, _ in self._sends:
            work.wait()
        self._finish_grad_sync()
        return self._loss

    def _key(self, action: Action, stage: int | None = None) -> tuple[int, int, int]:
        return (action.stage if stage is None else stage, action.microbatch, action.replica)

    def _run_f(self, action: Action) -> None:
        key, stage, last = self._key(action), action.stage, self.schedule.num_stages - 1
        if stage == 0:
            x = self._data[action.microbatch]
        else:
            received = self._handoff.pop(key, None)
            x = received if received is not None else self._recvs.pop(("act", *key))
            x = x.detach().requires_grad_(True)
        module = self.modules[(stage, action.replica)]
        if hasattr(module, "micro_batch"):  # a stage that needs its micro-batch's context (train/streams.py)
            module.micro_batch = action.microbatch
        if (stage, action.replica) in self._takes_ops:
            out = module(x, ops=DEFERRABLE if key in self._split else PLAIN)
        else:
            out = module(x)
        if stage == last:
            out = self.loss_fn(out, self._targets[action.microbatch])
            self._loss = out.detach() if self._loss is None else self._loss + out.detach()
        elif self.schedule.placement.rank_of(stage + 1, action.replica) == self.rank:
            self._handoff[self._key(action, stage + 1)] = out.detach()  # the turn of a V: a local copy
        else:  # the gradient for this output comes back from the next rank: its receive's shape
            self._out_shapes[key] = (out.shape, out.dtype)
        self._inputs[key], self._outputs[key] = x, out

    def _run_send_f(self, action: Action) -> None:
        key = self._key(action, action.stage + 1)
        out = self._outputs[self._key(action)].detach()
        message = self._messages[action]
        sent = self._sent_shapes.get(key)
        if sent is None:  # a header first: the send right before the activation, in the same place
            header = shape_header(out, self.device)
            self._advance(message.receiver, through=message)
            self._isend(header, self.pp_ranks[message.receiver], self._tag(0, *key))
            self._sent_shapes[key] = (tuple(out.shape), out.dtype)
        elif sent != (tuple(out.shape), out.dtype):
            raise ValueError(
                f"stage {action.stage} micro-batch {action.microbatch}: output {tuple(out.shape)} {out.dtype} "
                f"differs from the first step's {sent[0]} {sent[1]}; call reset_shapes() on every rank first"
            )
        self._send(message, out, self._tag(1, *key))

    def _run_recv_f(self, action: Action) -> None:
        self._recvs[("act", *self._key(action))] = self._wait_recv("act", action)

    def _run_recv_b(self, action: Action) -> None:
        self._grads[self._key(action)] = self._wait_recv("grad", action)

    def _output_grad(self, action: Action) -> torch.Tensor | None:
        """The gradient w.r.t. this stage's output: None for the loss, else received or handed over
        by the next stage on this rank."""
        key = self._key(action)
        if action.stage == self.schedule.num_stages - 1:
            return None
        received = self._grads.pop(key, None)
        return (
            received if received is not None else self._input_grads.pop(self._key(action, action.stage + 1))
        )

    def _params(self, action: Action) -> list[torch.nn.Parameter]:
        return self._params_of[(action.stage, action.replica)]

    def _backward(self, action: Action, defer_weight_grads: bool) -> None:
        """One pass over the stage's graph (then freed): the input gradient, and the parameter
        gradients, except those of deferrable linears when deferring, which wait for the W.
        Gradients land in .grad by autograd's accumulation (in place after the first micro-batch)."""
        key, params = self._key(action), self._params(action)
        grad_out = self._output_grad(action)
        x, out = self._inputs.pop(key), self._outputs.pop(key)
        # every parameter is asked for, deferred or not: autograd prunes nodes leading to none
        wrt = params + [x] if action.stage > 0 else params
        with self._weight_grads.deferring(key) if defer_weight_grads else nullcontext():
            torch.autograd.backward(out, grad_out, inputs=wrt)
        if action.stage > 0:
            self._input_grads[key] = x.grad

    def _run_b(self, action: Action) -> None:
        self._backward(action, defer_weight_grads=False)

    def _run_i(self, action: Action) -> None:
        self._backward(action, defer_weight_grads=True)

    def _run_w(self, action: Action) -> None:
        self._weight_grads.flush(self._key(action))

    def _run_send_b(self, action: Action) -> None:
        grad = self._input_grads.pop(self._key(action))
        self._send(
            self._messages[action], grad, self._tag(2, action.stage - 1, action.microbatch, action.replica)
        )

    def _run_grad_sync(self, action: Action) -> None:
        """Start summing this chunk's gradients with the other replica's copy (eager, asynchronous)."""
        other = 1 - action.replica
        peer = self._peer(action.stage, other)
        if peer == self.pp_ranks[self.rank]:  # odd pp: the middle rank holds both copies
            if (action.stage, other) not in self._local_synced:
                self._local_synced.add((action.stage, action.replica))
                return
            twin = self._params(Action(Kind.GRAD_SYNC, action.stage, None, other))
            for mine, theirs in zip(self._params(action), twin):
                mine.grad = mine.grad + theirs.grad
                theirs.grad = mine.grad.clone()
            return
        flat = self._flat_grads((action.stage, action.replica))
        self._send(self._messages[action], flat, self._tag(3, action.stage, 0, action.replica))

    def _flat_grads(self, key: tuple[int, int]) -> torch.Tensor:
        """The gradients of stage `key` as one 1-D tensor whose slices are the parameters' `.grad`:
        a view when they already lie back to back in one storage (ours from an earlier step, or a
        trainer's flat buffer), else one copy, after which `.grad` are views of it (later micro-batches
        and steps accumulate into it in place, so no per-step concatenation)."""
        params = self._params_of[key]
        grads = [p.grad for p in params]
        first, total = grads[0], sum(g.numel() for g in grads)
        start, storage = first.data_ptr(), first.untyped_storage().data_ptr()
        offset, size = 0, first.element_size()
        for g in grads:
            if (
                not g.is_contiguous()
                or g.dtype != first.dtype
                or g.data_ptr() != start + offset * size
                or g.untyped_storage().data_ptr() != storage
            ):
                break
            offset += g.numel()
        else:
            return first.as_strided((total,), (1,))
        flat = torch.cat([g.reshape(-1) for g in grads])
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

    def _finish_grad_sync(self) -> None:
        for key, work, buffer in self._sync_recvs:  # the other replica's sum, into our copy
            work.wait()
            self._flat_grads(key).add_(buffer)  # after every send was waited: the sent sums are ours
        if self.on_stage_grads_ready is not None:
            for key in self._synced:
                self.on_stage_grads_ready(key)


def _as_comm_group(group: CommGroup | dist.ProcessGroup | None, pp_ranks: Sequence[int]) -> CommGroup:
    """The pipeline's peers as a named `CommGroup` (a bare ProcessGroup or None is wrapped; None is
    the default group, which must then be the pp ranks' when there are several)."""
    if isinstance(group, CommGroup):
        return group
    initialized = dist.is_available() and dist.is_initialized()
    me = dist.get_rank() if initialized else pp_ranks[0]
    ranks = tuple(sorted(pp_ranks)) if me in pp_ranks else (me,)
    if group is None and initialized and len(ranks) > 1 and dist.get_world_size() == len(ranks):
        group = dist.group.WORLD
    return CommGroup("pp", ranks, group, me)


def shared_memory_p2p(group: CommGroup, device, wanted: bool | None):
    """The pp group's shared-memory p2p channel (collective), or None: off, one rank, not CPU/gloo."""
    if wanted is False or group.size == 1 or group.pg is None:
        return None
    on_cpu = device is None or torch.device(device).type == "cpu"
    if wanted is None and not (on_cpu and dist.get_backend(group.pg) == "gloo"):
        return None
    from shiftlm.comm import shm_p2p
    from shiftlm.kernels import cpu as cpu_kernels

    made = shm_p2p.enable(group, cpu_kernels.load())
    if made is None and wanted:
        raise RuntimeError(f"shm_p2p=True but no shared-memory channel could be made for {group}")
    return made
