"""The pipeline executor's messages: posting each pair's sends and receives in the pair's order.

`PairMessaging` is the communication half of `PipelineExecutor` (executor.py), split off to keep
files small; it uses the executor's state (`_pair_ops`, `_cursor`, `_op_index`, `_recvs`, ...).
For every pair of ranks both sides post one sequence, fixed from the schedule
(`p2p_order.pair_orders`): NCCL matches by posting order, gloo by tag (one tag per message). A send
is posted when its action runs; every receive as early as that order allows, into a buffer kept
across steps; a rank waits only at the RECV right before the action that needs the message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shiftlm.comm.p2p import irecv, isend
from shiftlm.pipeline.actions import Action
from shiftlm.pipeline.p2p_order import Message

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
_HEADER_SLOTS = 10  # dtype code, ndim, up to 8 dims


def shape_header(tensor: torch.Tensor, device) -> torch.Tensor:
    """The header a first step sends before an activation: its dtype code, ndim and shape (int64)."""
    fields = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
    return torch.tensor(fields + [0] * (_HEADER_SLOTS - len(fields)), device=device)


class PairMessaging:
    """Sends, receives and the per-pair posting cursor of one pipeline rank (mixed into the executor)."""

    def _peer(self, stage: int, replica: int) -> int:
        return self.pp_ranks[self.schedule.placement.rank_of(stage, replica)]

    def _tag(self, kind: int, stage: int, microbatch: int, replica: int) -> int:
        """A distinct tag per message: (what, stage, micro-batch, replica) -> int."""
        s = self.schedule
        return ((kind * 2 + replica) * s.num_stages + stage) * (s.microbatches + 1) + microbatch

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self._sends.append((isend(tensor, peer, self.group, tag=tag, shm=self._shm is not None), tensor))

    def _irecv(
        self, shape: Sequence[int], dtype: torch.dtype, peer: int, tag: int, keep: tuple | None = None
    ):
        """Post a receive; with `keep`, into the buffer that key received into last step (as PyTorch's
        stages keep theirs): nothing of a step outlives it, so the buffer is free again, and a step
        allocates no receive buffers."""
        buffer = None if keep is None else self._buffers.get(keep)
        if buffer is None or buffer.shape != tuple(shape) or buffer.dtype != dtype:
            buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
            if keep is not None:
                self._buffers[keep] = buffer
        return irecv(buffer, peer, self.group, tag=tag, shm=self._shm is not None), buffer

    def _advance(self, peer: int, through: Message | None = None) -> None:
        """Post, in the pair's order, the receives from pipeline rank `peer` that come next: as many as
        can be posted now (up to this rank's next send to it); with `through`, at least every operation
        before that message and the message itself when it is a receive, waiting for a first step's
        shape header where one is needed."""
        operations, position = self._pair_ops[peer], self._cursor[peer]
        target = -1 if through is None else self._op_index[through]
        while position < len(operations):
            is_send, message = operations[position]
            if is_send:
                if position < target:
                    raise RuntimeError(f"pipeline rank {self.rank}: {message} is not sent before {through}")
                break
            if not self._post_recv(message, wait=position <= target):
                break
            position += 1
        self._cursor[peer] = position

    def _post_recv(self, message: Message, wait: bool) -> bool:
        """Post the receive of `message`; False (nothing posted) if its shape is not known yet and
        `wait` is false. An activation's shape comes in a header on a first step."""
        peer, key = self.pp_ranks[message.sender], message.key
        if message.kind == "sync":
            mine = (message.stage, 1 - message.replica)
            buffer = self._sync_buffers.get(mine)  # kept across steps: the sum is added before the next
            if buffer is None:
                params = self._params_of[mine]
                numel, dtype = sum(p.numel() for p in params), params[0].dtype
                buffer = self._sync_buffers[mine] = torch.empty(numel, dtype=dtype, device=self.device)
            tag = self._tag(3, message.stage, 0, message.replica)
            work = irecv(buffer, peer, self.group, tag=tag, shm=self._shm is not None)
            self._sync_recvs.append((mine, work, buffer))
            return True
        if message.kind == "grad":
            if key not in self._out_shapes:
                if wait:
                    raise RuntimeError(f"pipeline rank {self.rank}: {message} before its forward ran")
                return False
            shape, dtype = self._out_shapes[key]
            self._recvs[("grad", *key)] = self._irecv(shape, dtype, peer, self._tag(2, *key), ("grad", *key))
            return True
        if key not in self._shapes:
            header = self._recvs.get(("header", *key))
            if header is None:
                header = self._irecv([_HEADER_SLOTS], torch.int64, peer, self._tag(0, *key))
                self._recvs[("header", *key)] = header
            if not wait:
                return False
            work, fields = self._recvs.pop(("header", *key))
            work.wait()
            dtype, shape = _DTYPES[int(fields[0])], tuple(fields[2 : 2 + int(fields[1])].tolist())
            self._shapes[key] = (shape, dtype)
        shape, dtype = self._shapes[key]
        self._recvs[("act", *key)] = self._irecv(shape, dtype, peer, self._tag(1, *key), ("act", *key))
        return True

    def _send(self, message: Message, tensor: torch.Tensor, tag: int) -> None:
        """Post the send of `message` at its place in the pair's order, then the receives after it."""
        self._advance(message.receiver, through=message)
        if self._cursor[message.receiver] != self._op_index[message]:
            raise RuntimeError(f"pipeline rank {self.rank}: {message} is sent out of its pair's order")
        self._cursor[message.receiver] += 1
        self._isend(tensor, self.pp_ranks[message.receiver], tag)
        self._advance(message.receiver)

    def _wait_recv(self, kind: str, action: Action) -> torch.Tensor:
        """The message `action` receives (its receive posted first, in the pair's order, if it is not yet)."""
        message = self._messages[action]
        self._advance(message.sender, through=message)
        work, buffer = self._recvs.pop((kind, *self._key(action)))
        work.wait()
        return buffer
