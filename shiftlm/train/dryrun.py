"""`shiftlm train --dry-run`: check a (planned) config without its cluster, one line per phase.

1. config  - the real model and layout pass every check `shiftlm train` makes before a rank starts.
2. memory  - the simulator's per-rank estimate of the real layout with the trainer's state sizes
             (`preflight.estimate`) as one GPU rank (bf16 activations), checked against the GPU
             when there is one.
3. stand-in - a tiny model with the same layout: the same tp/sp/cp/pp/dp degrees, ZeRO stage,
             schedule, chunks, recompute, micro-batch and micro-batches per replica (at most 2 per
             stage: warm-up, steady state and cool-down all occur; more repeats); hidden 64, one
             layer per pipeline stage, 2*sp*tp query heads, the embedded 2048-token vocabulary and
             the shortest sequence the cp/sp split allows. A layout larger than `max_ranks` local
             ranks is scaled axis by axis: the largest axis above 2 is halved (dp first on a tie)
             until it fits, so every axis that is parallel in the real layout stays parallel (>= 2)
             and every collective kind, the ZeRO sharding and the pipeline schedule still run.
4. step    - one optimizer step of the stand-in on local gloo ranks (build, forward/backward through
             the schedule, gradient sync / ZeRO, AdamW, checkpoint save).
5. check   - its loss (rel 1e-5) and global gradient norm (rel 5e-5) equal a one-rank run of the
             same stand-in, so the layout computes the single-rank model's step. The norm's squares
             are summed pairwise (`zero.global_grad_norm`); by `torch.dot` one rank's norm came out
             up to 7.8e-5 low (the Mixtral tp2 x sp4 x pp8 plans' misses), with it the four such
             plans are within 8.5e-8.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.train.config import TrainConfig

AXES = ("dp", "pp", "cp", "sp", "tp")
STAND_IN_HIDDEN, STAND_IN_HEAD_DIM, STAND_IN_VOCAB = 64, 16, 2048
TOLERANCE = {"loss": 1e-5, "grad_norm": 5e-5}  # fp32 (module docstring)

Launch = Callable[[TrainConfig, int], dict]


def scaled_degrees(config: TrainConfig, max_ranks: int) -> dict[str, int]:
    """Per-axis degrees for at most `max_ranks` ranks: halve the largest axis above 2 (dp first on a
    tie; odd degrees go straight to 2) until the product fits. Axes at 1 stay 1, axes above 1 stay >= 2."""
    degrees = {axis: getattr(config.parallel, axis) for axis in AXES}

    def world() -> int:
        return degrees["dp"] * degrees["pp"] * degrees["cp"] * degrees["sp"] * degrees["tp"]

    while world() > max_ranks:
        above = [axis for axis in AXES if degrees[axis] > 2]
        if not above:
            raise ConfigError(
                f"the stand-in keeps every parallel axis of the layout at >= 2, which needs {world()} "
                f"local ranks: pass --dry-run-ranks {world()} (or more)"
            )
        axis = max(above, key=lambda a: (degrees[a], a == "dp"))
        degrees[axis] = degrees[axis] // 2 if degrees[axis] % 2 == 0 else 2
    return degrees


def stand_in_model(real: ModelConfig, degrees: dict[str, int], stages: int) -> ModelConfig:
    """Tiny model of the real one's family (type, tied embeddings, GQA or MHA, sliding window) that the
    stand-in layout can split: 2*sp*tp query heads, sp*tp KV heads (GQA), one layer per stage."""
    shift = degrees["sp"] * degrees["tp"]
    heads = 2 * shift
    kv = heads if real.num_kv_heads == real.num_heads else shift
    moe = {}
    if real.is_moe:  # two experts per ep rank, every layer routed, the real router's settings
        experts = 2 * degrees.get("ep", 1)
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=min(real.num_experts_per_tok, experts),
            moe_intermediate_size=2 * STAND_IN_HIDDEN,
            shared_expert_intermediate_size=2 * STAND_IN_HIDDEN
            if real.shared_expert_intermediate_size
            else 0,
            norm_topk_prob=real.norm_topk_prob,
            router_aux_loss_coef=real.router_aux_loss_coef,
            output_router_logits=real.output_router_logits,
            qk_norm=real.qk_norm,
        )
    return ModelConfig(
        vocab_size=STAND_IN_VOCAB,
        hidden_size=STAND_IN_HIDDEN,
        intermediate_size=2 * STAND_IN_HIDDEN,
        num_layers=max(stages, 2),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=STAND_IN_HEAD_DIM,
        tie_word_embeddings=real.tie_word_embeddings,
        attention_bias=real.attention_bias,
        sliding_window=real.sliding_window,
        model_type=real.model_type,
        bos_token_id=0,
        eos_token_id=0,
        **moe,
    )


def stand_in_experts(parallel, degrees: dict[str, int]) -> dict[str, int]:
    """ep and etp of the stand-in. ep is folded over dp x cp x sp (with etp = tp): it keeps what of it
    still divides the scaled token ranks; a separate etp keeps its largest divisor that, with ep,
    still folds over the stand-in's stage ranks (`ParallelConfig.check_experts`)."""
    tp, tokens = degrees["tp"], degrees["dp"] * degrees["cp"] * degrees["sp"]
    if parallel.expert_tp != parallel.tp:
        stage = tokens * tp
        for etp in sorted(
            (d for d in range(1, parallel.expert_tp + 1) if parallel.expert_tp % d == 0), reverse=True
        ):
            ep = math.gcd(parallel.ep, stage // etp) if stage % etp == 0 else 0
            if ep and etp != tp and ep * etp % tp == 0:
                return {"ep": ep, "etp": etp}
    return {"ep": math.gcd(parallel.ep, tokens), "etp": 0}


def stand_in_micro_batches(config: TrainConfig, pp: int) -> int:
    """Micro-batches per replica: the real count up to 2 per stand-in pipeline stage (at least 4):
    the schedule's warm-up, steady state and cool-down all occur; more only repeats the steady state."""
    from shiftlm.train.pipeline import resolved_chunks

    stages = pp * resolved_chunks(config)
    return min(config.accumulation, max(2 * stages, 4))


def stand_in_config(
    config: TrainConfig, degrees: dict[str, int], model_dir: Path, log_dir: Path
) -> TrainConfig:
    """The real config with the stand-in's layout, model, sequence and data; one step, fresh run dir."""
    from shiftlm.train.pipeline import resolved_chunks

    small = copy.deepcopy(config)
    degrees = {**degrees, **stand_in_experts(config.parallel, degrees)}
    small.parallel = dataclasses.replace(small.parallel, **degrees)
    split = 2 * degrees["cp"] * degrees["sp"] if degrees["cp"] > 1 else degrees["sp"]
    small.train.seq_len = split * -(-32 // split)
    small.train.global_batch = (
        stand_in_micro_batches(config, degrees["pp"]) * config.train.micro_batch * degrees["dp"]
    )
    small.train.steps = 1
    small.model.name = str(model_dir)
    small.data.source, small.data.tokenizer, small.data.vocab_size = "stdlib", "", STAND_IN_VOCAB
    small.checkpoint.resume, small.checkpoint.overwrite, small.checkpoint.every = False, True, 0
    small.log.dir, small.log.progress = str(log_dir), "off"
    small.validation.freq = 0
    small.monitor.straggler_every = 0
    stages = small.parallel.pp * resolved_chunks(small)
    model = stand_in_model(_real_model(config), degrees, stages)
    (model_dir / "config.json").write_text(json.dumps(model.to_hf_dict()))
    return small


def _real_model(config: TrainConfig) -> ModelConfig:
    from shiftlm.train.setup import model_config

    return model_config(config.model.name, config.data.vocab_size, 0)[0]


def single_rank(config: TrainConfig) -> TrainConfig:
    reference = copy.deepcopy(config)
    reference.parallel = dataclasses.replace(reference.parallel, **dict.fromkeys((*AXES, "ep"), 1), etp=0)
    reference.train.zero = 0
    reference.train.schedule, reference.train.chunks = "1f1b", 1
    reference.log.dir = str(Path(config.log.dir).with_name("reference"))
    return reference


def launch_local(config: TrainConfig, nproc: int) -> dict:
    """The stand-in on `nproc` supervised local gloo workers (one rank: this process)."""
    from shiftlm.train.elastic import launch_local as supervised
    from shiftlm.train.elastic import run_training

    if nproc == 1:
        summary = run_training(config.to_dict(), quiet=True)
        if "user_error" in summary:
            raise ConfigError(summary["user_error"]["message"], summary["user_error"]["exit_code"])
        return summary
    return supervised(config, nproc, quiet=True)


def _first_step(config: TrainConfig, summary: dict) -> dict:
    """Loss and grad norm of step 1 from the run's metrics.jsonl (rank 0 wrote it)."""
    line = (Path(config.log.dir) / "metrics.jsonl").read_text().splitlines()[0]
    record = json.loads(line)
    return {"loss": record["loss"], "grad_norm": record["grad_norm"]}


def dry_run(config: TrainConfig, max_ranks: int = 8, launch: Launch = launch_local) -> dict:
    """Every phase's result (see the module docstring); raises ConfigError at the first that fails."""
    from shiftlm.train.preflight import estimate
    from shiftlm.train.setup import model_shape

    p = config.parallel
    phases: dict[str, dict] = {}
    model = model_shape(config)  # every layout check against the real model
    axes = (*AXES, "ep") if p.ep > 1 else AXES
    axes = (*axes, "etp") if p.expert_tp != p.tp else axes
    phases["config"] = {
        "model": config.model.name,
        "params": model.num_params,
        "layout": {axis: getattr(p, axis) for axis in axes},  # ep and etp (folded, docs/moe.md) where used
        "world_size": p.world_size,
        "zero": config.train.zero,
        "schedule": config.train.schedule if p.pp > 1 else "none",
        "micro_batches_per_replica": config.accumulation,
    }
    memory = estimate(config, model, p.world_size, on_gpu=True)
    here = memory["available_gib"] != float("inf")
    phases["memory"] = {
        "per_rank_gib": memory["per_rank_gib"],
        "device": memory["device"] if here else None,
        "fits": memory["fits"] if here else None,
    }
    if here and not memory["fits"]:
        raise ConfigError(
            f"{config.model.name} needs ~{memory['per_rank_gib']['total']} GiB per rank but {memory['device']} "
            f"has {memory['available_gib']} GiB: shard it further (zero, pp, tp) or use train.recompute=full",
            5,
        )
    degrees = scaled_degrees(config, max_ranks)
    with tempfile.TemporaryDirectory(prefix="shiftlm-dry-run-") as tmp:
        small = stand_in_config(config, degrees, Path(tmp), Path(tmp) / "stand-in")
        stand_in = _real_model(small)
        world = small.parallel.world_size
        phases["stand_in"] = {
            "layout": degrees,
            "ranks": world,
            "scaled": {a: [getattr(p, a), d] for a, d in degrees.items() if getattr(p, a) != d},
            "micro_batches_per_replica": [config.accumulation, small.accumulation],
            "model": {
                "layers": stand_in.num_layers,
                "hidden": stand_in.hidden_size,
                "heads": stand_in.num_heads,
                "kv_heads": stand_in.num_kv_heads,
                "vocab": stand_in.vocab_size,
            },
            "seq_len": small.train.seq_len,
            "global_batch": small.train.global_batch,
        }
        tick = time.perf_counter()
        summary = launch(small, world)
        step = _first_step(small, summary)
        phases["step"] = {"ranks": world, "seconds": round(time.perf_counter() - tick, 2), **step}
        reference = single_rank(small)
        expected = _first_step(reference, launch(reference, 1))
    errors = {k: abs(step[k] - expected[k]) / max(abs(expected[k]), 1e-12) for k in ("loss", "grad_norm")}
    phases["check"] = {"single_rank": expected, "rel_diff": errors, "tolerance": TOLERANCE}
    if any(errors[k] > TOLERANCE[k] for k in errors):
        raise ConfigError(
            f"the stand-in's step differs from one rank's (loss {step['loss']} vs {expected['loss']}, "
            f"grad norm {step['grad_norm']} vs {expected['grad_norm']}): a bug in this layout, please report it",
            1,
        )
    return phases


def phase_lines(phases: dict) -> list[str]:
    """One line per phase (what `shiftlm train --dry-run` prints)."""
    c, m, s, st, ch = (phases[k] for k in ("config", "memory", "stand_in", "step", "check"))
    lay = " x ".join(f"{a}{d}" for a, d in c["layout"].items() if d > 1) or "one rank"
    per = m["per_rank_gib"]
    parts = ", ".join(
        f"{k} {per[k]}" for k in ("weights", "gradients", "optimizer", "activations", "reserve")
    )
    device = f"; fits {m['device']}" if m["fits"] else "; no GPU here to check it against"
    device = " as one GPU rank" + device
    scaled = [f"{a} {real} -> {d}" for a, (real, d) in s["scaled"].items()]
    real_mb, small_mb = s["micro_batches_per_replica"]
    if real_mb != small_mb:
        scaled.append(f"micro-batches per replica {real_mb} -> {small_mb}")
    scaled = ", ".join(scaled) or "none"
    sm = s["model"]
    return [
        f"config:   ok: {c['model']} ({params_text(c['params'])} params) on {lay} = {c['world_size']} ranks, "
        f"zero {c['zero']}, schedule {c['schedule']}, {c['micro_batches_per_replica']} micro-batches per replica",
        f"memory:   {per['total']} GiB per rank ({parts}){device}",
        f"stand-in: {s['ranks']} local gloo ranks (scaled: {scaled}); {sm['layers']} layers x {sm['hidden']} "
        f"wide, {sm['heads']} heads ({sm['kv_heads']} KV), vocab {sm['vocab']}, seq {s['seq_len']}, "
        f"global batch {s['global_batch']}",
        f"step:     1 step on {st['ranks']} ranks in {st['seconds']} s: loss {st['loss']:.6f}, grad norm {st['grad_norm']:.6f}",
        f"check:    equal to one rank's stand-in step (rel diff loss {ch['rel_diff']['loss']:.1e} <= "
        f"{ch['tolerance']['loss']:.0e}, grad norm {ch['rel_diff']['grad_norm']:.1e} <= {ch['tolerance']['grad_norm']:.0e})",
    ]


def params_text(count: float) -> str:
    """7.0M, 1.1B, 405B: a parameter count in its largest unit."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{count:.0f}"
