"""The parallel layout: World = DP x PP x CP x SP x TP (and EP folded over the token ranks), and every
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

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "cp", "sp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

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
        """ep divides the experts and the dp*cp*sp ranks it is folded over; tp (which also splits every
        expert's FFN, expert TP = TP; serving's full TP: sp*tp) divides the expert and shared-expert widths."""
        token_ranks = self.dp * self.cp * self.sp
        if self.ep > 1 and not model.is_moe:
            raise ConfigError(
                f"ep = {self.ep} needs a mixture-of-experts model: {model.model_type} is dense; use ep = 1"
            )
        if not model.is_moe:
            return
        if model.num_experts % self.ep:
            raise ConfigError(
                f"ep = {self.ep} must divide num_experts = {model.num_experts}: use ep in "
                f"{_divisors(model.num_experts)}"
            )
        if token_ranks % self.ep:
            raise ConfigError(
                f"ep = {self.ep} must divide the data-parallel ranks dp*cp*sp = {token_ranks} it is folded "
                f"over: raise dp to a multiple of {self.ep} or use ep in {_divisors(token_ranks)}"
            )
        for what, width in (
            ("moe_intermediate_size (one expert's width)", model.moe_intermediate_size),
            ("shared_expert_intermediate_size", model.shared_expert_intermediate_size),
        ):
            if width and width % self.tp:
                raise ConfigError(
                    f"tp = {self.tp} (which splits every expert too) must divide {what} = {width}: use tp in "
                    f"{[d for d in _divisors(width) if d <= width]}"
                )
            if shift and width and width % self.shift_size:
                raise ConfigError(
                    f"sp*tp = {self.shift_size} must divide {what} = {width} (full TP splits every expert "
                    f"over all {self.shift_size} serving ranks): use sp*tp in {_divisors(width)}"
                )

    def check_sequence(self, seq_len: int) -> None:
        """The sequence splits into 2*cp zigzag chunks, each chunk pair over sp (and tp with Megatron SP)."""
        sp_chunks = self.sp * (self.tp if self.sequence_parallel else 1)
        split = f"sp{'*tp' if self.sequence_parallel else ''}"
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
