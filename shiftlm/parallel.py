"""The parallel layout: World = DP x PP x CP x SP x TP (and the experts' EP x ETP folded over each
stage's ranks), and every
rule of what a model can be split into (`ParallelConfig.check_model`), checked before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shiftlm.config import ModelConfig, ceil_to_multiple
from shiftlm.errors import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    """World = DP x PP x CP x SP x TP, TP innermost: rank = (((dp*PP + pp)*CP + cp)*SP + sp)*TP + tp.

    `sequence_parallel` turns on Megatron sequence-parallel regions (norms and residuals split along
    the sequence inside the TP group); `sp` is Ulysses sequence parallelism (all-to-all around attention);
    `cp` is context parallelism (ring attention over a load-balanced "zigzag" split of the sequence,
    docs/context_parallel.md). With both, the sequence is split over cp first, then over sp.

    Mixture-of-experts layers are laid out on their own (Megatron-Core's MoE parallel folding,
    docs/moe.md): the DP*CP*SP*TP ranks of a pipeline stage, in stage order `r = f*TP + tp` (token rank
    `f = (dp*CP + cp)*SP + sp`), are re-cut as `r = (edp*EP + ep)*ETP + etp`: `etp` (innermost,
    ETP consecutive ranks) splits every expert's width, `ep` (stride ETP) the experts, and `edp`
    (stride EP*ETP) holds replicas of the same expert shards. ETP = TP (the default) is expert TP = TP:
    the etp group is the tp group and ep is folded over dp x cp x sp alone.
    """

    dp: int = 1
    pp: int = 1
    sp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    # expert parallelism, folded over the dp x cp x sp ranks (not a factor of the world size): each
    # expert lives on one of `ep` ranks, tokens travel to it by all-to-all (docs/moe.md)
    ep: int = 1
    # the experts' own tensor-parallel size (Megatron-Core's expert_tensor_parallel_size); 0: tp
    etp: int = 0

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "cp", "sp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp < 0:
            raise ConfigError(f"etp must be a positive integer (or 0: the same as tp), got {self.etp!r}")

    @property
    def expert_tp(self) -> int:
        """ETP: the ranks that split each expert's width (`etp`, or tp when it is 0)."""
        return self.etp or self.tp

    @property
    def experts_apart(self) -> bool:
        """The experts have groups of their own (ep > 1 or ETP != TP): their gradients are summed and
        sharded over `edp` rather than dp_sp."""
        return self.ep > 1 or self.expert_tp != self.tp

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.sp * self.tp

    @property
    def shift_size(self) -> int:
        """P = SP*TP: the ranks of one (dp, pp, cp) slice, which full-TP serving shards over."""
        return self.sp * self.tp

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            cp = f" cp={self.cp}" if self.cp > 1 else ""
            product = "dp*pp*cp*sp*tp" if self.cp > 1 else "dp*pp*sp*tp"
            raise ConfigError(
                f"layout dp={self.dp} pp={self.pp}{cp} sp={self.sp} tp={self.tp} needs "
                f"{self.world_size} ranks but the world has {world_size}: start "
                f"{self.world_size} processes (e.g. torchrun --nproc-per-node {self.world_size}) "
                f"or change the layout so that {product} = {world_size}"
            )

    def check_model(self, model: ModelConfig, chunks: int = 1, shift: bool = False) -> None:
        """Fail early, with the fix, on layouts this model cannot be split into: the one place the
        trainer, the server, `verify`, the simulator and the planners check divisibility. `chunks`:
        pipeline stages per rank (interleaved and V schedules); `shift`: serving, whose full-TP mode
        splits every weight over all sp*tp ranks."""
        p, heads, kv = self.shift_size, model.num_heads, model.num_kv_heads
        if heads % p:
            raise ConfigError(
                f"sp*tp = {p} must divide num_attention_heads = {heads}: use sp*tp in {_divisors(heads)}"
            )
        if kv % p and p % kv:
            valid = [d for d in _divisors(heads) if kv % d == 0 or d % kv == 0]
            raise ConfigError(
                f"num_key_value_heads = {kv} and sp*tp = {p} must divide one another so that every "
                f"rank's query heads share whole KV heads: use sp*tp in {valid}"
            )
        if shift and model.intermediate_size % p:
            valid = [d for d in _divisors(heads) if model.intermediate_size % d == 0]
            raise ConfigError(
                f"sp*tp = {p} must divide intermediate_size = {model.intermediate_size} (full TP splits "
                f"the MLP over all {p} serving ranks): use sp*tp in {valid}"
            )
        if model.intermediate_size % self.tp:
            raise ConfigError(
                f"tp = {self.tp} must divide intermediate_size = {model.intermediate_size}: use tp in "
                f"{[d for d in _divisors(heads) if model.intermediate_size % d == 0]}"
            )
        stages = self.pp * chunks
        if stages > model.num_layers:
            what = f"pp x chunks = {stages} pipeline stages" if chunks > 1 else f"pp = {self.pp}"
            raise ConfigError(
                f"{what} is more than the model's {model.num_layers} layers: lower pp"
                + (" or the chunks per rank" if chunks > 1 else f" to <= {model.num_layers}")
            )
        self.check_experts(model, shift)
        if self.cp > 1 and model.sliding_window is not None:
            raise ConfigError(
                f"cp = {self.cp} (ring attention) does not support sliding-window attention "
                f"(sliding_window = {model.sliding_window}): use cp = 1 (sp and tp support it)"
            )

    def check_experts(self, model: ModelConfig, shift: bool = False) -> None:
        """ep divides the experts; ep x etp folds over a stage's dp*cp*sp*tp ranks (docs/moe.md); etp
        divides an expert's width and tp the shared expert's (serving's full TP: sp*tp divides both)."""
        etp, stage_ranks = self.expert_tp, self.dp * self.cp * self.sp * self.tp
        if self.experts_apart and not model.is_moe:
            what = f"ep = {self.ep}" if self.ep > 1 else f"etp = {self.etp}"
            raise ConfigError(
                f"{what} needs a mixture-of-experts model: {model.model_type} is dense; drop it"
                + (" (use ep = 1)" if self.ep > 1 else "")
            )
        if not model.is_moe:
            return
        if model.num_experts % self.ep:
            raise ConfigError(
                f"ep = {self.ep} must divide num_experts = {model.num_experts}: use ep in "
                f"{_divisors(model.num_experts)}"
            )
        width = model.moe_intermediate_size
        if etp == self.tp:
            token_ranks = stage_ranks // self.tp
            if token_ranks % self.ep:
                raise ConfigError(
                    f"ep = {self.ep} must divide the data-parallel ranks dp*cp*sp = {token_ranks} it is "
                    f"folded over: raise dp to a multiple of {self.ep} or use ep in {_divisors(token_ranks)}"
                )
        else:
            if shift:
                raise ConfigError(
                    f"etp = {self.etp}: serving splits every expert over its sp*tp ranks; drop etp (or set it to tp)"
                )
            if etp > width:
                raise ConfigError(
                    f"etp = {etp} is larger than an expert's width moe_intermediate_size = {width}: "
                    f"use etp in {_divisors(width)}"
                )
            if width % etp:
                raise ConfigError(
                    f"etp = {etp} must divide moe_intermediate_size (one expert's width) = {width}: use etp in "
                    f"{_divisors(width)}"
                )
            if stage_ranks % (self.ep * etp):
                raise ConfigError(
                    f"ep x etp = {self.ep * etp} must divide the dp*cp*sp*tp = {stage_ranks} ranks of a "
                    f"pipeline stage they are folded over: raise dp or use ep x etp in {_divisors(stage_ranks)}"
                )
            if self.ep * etp % self.tp:
                raise ConfigError(
                    f"ep x etp = {self.ep * etp} must be a multiple of tp = {self.tp} (an expert's replicas, "
                    f"edp, must fit in the dense weights' data group): raise ep or etp, or use etp = tp"
                )
        for what, size, value, name in (
            ("moe_intermediate_size (one expert's width)", etp, width, "etp" if etp != self.tp else "tp"),
            ("shared_expert_intermediate_size", self.tp, model.shared_expert_intermediate_size, "tp"),
        ):
            if value and value % size:
                splits = " (which splits every expert too)" if name == "tp" and etp == self.tp else ""
                raise ConfigError(
                    f"{name} = {size}{splits} must divide {what} = {value}: use {name} in "
                    f"{[d for d in _divisors(value) if d <= value]}"
                )
            if shift and value and value % self.shift_size:
                raise ConfigError(
                    f"sp*tp = {self.shift_size} must divide {what} = {value} (full TP splits every expert "
                    f"over all {self.shift_size} serving ranks): use sp*tp in {_divisors(value)}"
                )

    def check_sequence(self, seq_len: int) -> None:
        """The sequence splits into 2*cp zigzag chunks, each chunk pair over sp (and tp with Megatron SP)."""
        sp_chunks = self.sp * (self.tp if self.sequence_parallel else 1)
        split = f"sp{'*tp' if self.sequence_parallel else ''}"
        folded = self.cp * self.sp * self.tp
        if self.expert_tp != self.tp and not self.sequence_parallel and seq_len % folded:
            raise ConfigError(
                f"etp = {self.etp} != tp = {self.tp}: each tp rank hands the experts 1/tp of its sequence, so "
                f"the sequence length {seq_len} must be a multiple of cp*sp*tp = {folded}: use e.g. "
                f"{ceil_to_multiple(seq_len, folded)}, or turn on sequence_parallel"
            )
        if self.cp > 1:
            chunks = 2 * self.cp * sp_chunks
            if chunks > seq_len:
                raise ConfigError(
                    f"2*cp*{split} = {chunks} is larger than the sequence length {seq_len}: "
                    f"lower cp or {split.split('*')[0]}, or train on sequences of at least {chunks} tokens"
                )
            if seq_len % chunks:
                raise ConfigError(
                    f"sequence length {seq_len} must split into 2*cp*{split} = {chunks} equal chunks "
                    f"(ring attention's load-balanced split): use a multiple of {chunks}, "
                    f"e.g. {ceil_to_multiple(seq_len, chunks)}"
                )
            return
        if seq_len % sp_chunks:
            raise ConfigError(
                f"sequence length {seq_len} must split evenly into {split}"
                f" = {sp_chunks} chunks: pad the sequence to a multiple of {sp_chunks} or lower sp"
            )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
