"""A step the engine launched and has not yet read (`Engine.step`, asynchronous scheduling): its plan,
logits, the rows it draws and for whom, and its draws, still on the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shiftlm.serve.engine.requests import Request
from shiftlm.serve.engine.sampling import Draw, SampleRow, TokenLogprob
from shiftlm.serve.plan import PENDING, StepPlan


@dataclass(eq=False)
class Launched:
    """A step whose model ran and whose tokens are drawn, on the device, but not yet read."""

    plan: StepPlan
    logits: torch.Tensor
    rows: list[SampleRow] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)  # the request of each row
    drawing: list[tuple[Request, int]] = field(default_factory=list)  # (request, how many rows it draws)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> traceback
    pending_row: dict[int, int] = field(default_factory=dict)  # seq id -> its draw's row (runs ahead)
    draw: Draw | None = None
    picks: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # `draw` failed: row by row

    def token(self, seq_id: int) -> torch.Tensor:
        """The token this step drew for one sequence, [1], where it was drawn."""
        i = self.pending_row[seq_id]
        if self.draw is None:
            return torch.tensor([self.picks[i][0]], dtype=torch.long, device="cpu")
        return self.draw.tokens[i : i + 1]

    def pending_tokens(self, plan: StepPlan) -> torch.Tensor | None:
        """This step's draws that `plan` (the next step) carries as `PENDING`, in the plan's order."""
        index = [
            self.pending_row[chunk.seq_id] for chunk in plan.chunks for t in chunk.token_ids if t == PENDING
        ]
        if not index:
            return None
        if self.draw is None:  # drawn row by row on the host
            return torch.tensor([self.picks[i][0] for i in index], dtype=torch.long, device="cpu")
        where = torch.tensor(index, dtype=torch.long, device="cpu").to(
            self.draw.tokens.device, non_blocking=True
        )
        return self.draw.tokens[where]
