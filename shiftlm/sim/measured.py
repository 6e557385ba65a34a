"""The measured training runs in shiftlm/data/measured/ (sources in shiftlm/data/README.md), turned into (model, layout, cluster) cases.

Each table is replayed with the software of its paper: Megatron-LM 2021-22 ran fp16, rank order
tp-dp-pp, no FlashAttention, no DP overlap, no ZeRO; Megatron Table 1 and vTrain used full
activation recompute; Korthikanti Table 5 gives full recompute vs SP + selective recompute.
What each table reports is compared as reported: Megatron Table 1 gives TFLOP/s per GPU counted
with recompute (F = 96Bslh^2(1 + s/6h + V/16lh), Narayanan et al. 2021, Sec. 5.1), llm-foundry's
H100 table tokens per second per GPU, the others iteration time.

llm-foundry's H100 bf16 table (MosaicML MPT models, Composer + PyTorch FSDP FULL_SHARD, i.e. ZeRO-3
over all GPUs, bf16 autocast, flash attention, full activation checkpointing where the row says so)
and its A100 80GB table (the same framework and models) fit only the framework's own parameters
("field@llm-foundry", `Case.software`), every other row of each: two tables determine each of them,
and under leave-one-table-out each GPU generation predicts the other (the shared constants carry to
H100 through the published achievable-matmul share, `Hardware.matmul_fraction`). torchtitan's H100
table is never fitted; every table is scored by a refit that never saw it (`sim.loto`).
"""

from __future__ import annotations

import csv
import gzip
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from shiftlm.data import MEASURED_DIR
from shiftlm.hardware import CATALOG, GIB, GIGA, Hardware, power_capped, with_links
from shiftlm.presets import PRESETS, ModelConfig, gpt_style
from shiftlm.sim.layout import MEGATRON_ORDER, Layout, eager_llama_pointwise_bytes

H100 = CATALOG["h100-sxm"]
LLM_FOUNDRY = "llm-foundry"  # MosaicML's Composer + FSDP + MPT (triton attention) stack

A100 = CATALOG["a100-80gb"]
VTRAIN_CLUSTER = "a100-80gb-vtrain"
VTRAIN_NCCL = "vtrain_a100_nccl_allreduce.csv.gz"


def vtrain_allreduce_table(data_dir: Path = MEASURED_DIR) -> tuple:
    """vTrain's measured NCCL all-reduce times on its A100 node, 2-8 GPUs, 1 MiB to 1 GiB in 1 MiB
    steps (shiftlm/data/README.md): the in-place column, as Megatron-LM all-reduces its activations
    in place. `Hardware.allreduce_table` rows."""
    path = data_dir / VTRAIN_NCCL
    if not path.exists():
        raise ValueError(f"{path} is missing; reinstall shiftlm (the package ships {VTRAIN_NCCL})")
    groups: dict[int, list[tuple[float, float]]] = {}
    with gzip.open(path, "rt") as handle:
        for row in csv.DictReader(handle):
            groups.setdefault(int(row["gpus"]), []).append(
                (float(row["size_bytes"]), float(row["time_ns_in_place"]) * 1e-9)
            )
    return tuple(
        (ranks, tuple(size for size, _ in sorted(rows)), tuple(time for _, time in sorted(rows)))
        for ranks, rows in sorted(groups.items())
    )


def vtrain_testbed(data_dir: Path = MEASURED_DIR) -> Hardware:
    """vTrain's A100 cluster: 800 Gb/s InfiniBand per 8-GPU node (100 GB/s, 12.5 GB/s per GPU; its
    predictor sends a hand-off at a quarter of it, i.e. four 200 Gb/s NICs per node), and the NVLink
    of its node as measured: intra-node all-reduces from its nccl-tests tables, other NVLink traffic
    at the bus bandwidth of its largest 8-GPU all-reduce (~220 GB/s; its README says 150 GB/s)."""
    table = vtrain_allreduce_table(data_dir)
    ranks, sizes, times = max(table)
    busbw = 2 * (ranks - 1) / ranks * sizes[-1] / times[-1]
    hardware = with_links(A100, intra=busbw, inter=100 * GIGA / 8, name=VTRAIN_CLUSTER)
    return replace(hardware, allreduce_table=table)


TABLES = {
    "megatron_2021_table1": "megatron_2021_table1_a100.csv",
    "korthikanti_2022_table5": "korthikanti_2022_table5_a100.csv",
    "vtrain_multi_node": "vtrain_a100_multi_node.csv",
    "vtrain_single_node": "vtrain_a100_single_node.csv",
    "llmfoundry_h100": "llmfoundry_h100_bf16.csv",
    "llmfoundry_a100": "llmfoundry_a100_bf16.csv",
    "torchtitan_h100": "torchtitan_h100_bf16.csv",
    "megatron_core_moe_h100": "megatron_core_moe_h100_bf16.csv",
}


@dataclass(frozen=True)
class Case:
    table: str
    label: str
    model: ModelConfig
    layout: Layout
    hardware: Hardware
    measured: float
    metric: str  # "tflops_per_gpu", "iteration_s" or "tokens_per_s_per_gpu"
    dtype: str = "fp16"  # Megatron-era runs ran fp16
    software: str = ""  # a framework whose own parameters ("field@software") apply to every GPU it ran on

    def predicted(self, step_time: float) -> float:
        """The table's metric from a simulated step time."""
        if self.metric == "iteration_s":
            return step_time
        if self.metric == "tokens_per_s_per_gpu":
            layout = self.layout
            return layout.global_batch * layout.seq_len / (step_time * layout.gpus)
        m, layout = self.model, self.layout
        h, s, v, layers = m.hidden_size, layout.seq_len, m.vocab_size, m.num_layers
        flops = 96 * layout.global_batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        return flops / (step_time * layout.gpus) / 1e12


# Megatron-LM's fp16 optimizer step (megatron/optimizer/optimizer.py, 2021-22), HBM bytes per local
# parameter: fp16 grads copied to fp32 main grads (2 + 4), unscale and inf check (4 + 4), the grad
# norm (4), apex FusedAdam (param, grad, m, v read, param, m, v written: 28), fp32 params copied back
# to the fp16 model (4 + 2): 52, against a fused Adam's 30.
MEGATRON_OPTIMIZER_BYTES = 52.0
# Megatron-LM as Table 1 ran it (PyTorch 20.12 container, early 2021) kept fp16 gradients in
# `param.grad`, where autograd adds each micro-batch's weight gradients after the first with its own
# kernel (read both, write one: 6 bytes per parameter). Later Megatron-LM (Korthikanti's 2022 runs,
# vTrain's) accumulates into fp32 `main_grad`, inside the wgrad GEMM where apex provides the fused
# kernel (`--gradient-accumulation-fusion`); replayed with no such cost, as their fit rows agree
# (bench/results/simulator_history.md, "Megatron T1 against Korthikanti T5").
MEGATRON_2021_GRAD_ACCUMULATION = 6.0


def _megatron_layout(
    row: dict, recompute: str, chunks: int, tp_sp: bool = False, grad_accumulation_bytes: float = 0.0
) -> Layout:
    pp, microbatches = int(row["pp"]), int(row["global_batch"]) // (int(row["dp"]) * int(row["micro_batch"]))
    # Megatron's 1F1B caps its warm-up at the micro-batch count: with fewer micro-batches than stages it
    # runs every forward, then every backward, which is GPipe's order (shiftlm's 1f1b refuses m < pp)
    one_f_one_b = "1f1b" if microbatches >= pp else "gpipe"
    return Layout(
        dp=int(row["dp"]),
        pp=pp,
        tp=int(row["tp"]),
        micro_batch=int(row["micro_batch"]),
        global_batch=int(row["global_batch"]),
        seq_len=int(row["seq"]),
        schedule="interleaved_1f1b" if chunks > 1 else one_f_one_b,
        chunks=chunks,
        recompute=recompute,
        zero=0,
        sequence_parallel=tp_sp,
        flash_attention=False,
        overlap_grad_sync=False,
        rank_order=MEGATRON_ORDER,
        blocking_p2p=True,
        grad_accumulation_bytes=grad_accumulation_bytes,
        optimizer_bytes=MEGATRON_OPTIMIZER_BYTES,
    )


def _gpt(row: dict) -> ModelConfig:
    return gpt_style(int(row["hidden"]), int(row["layers"]), int(row["heads"]), int(row["vocab"]))


def _megatron_table1(row: dict) -> Case:
    layers, pp = int(row["layers"]), int(row["pp"])
    per_virtual = row["layers_per_virtual_stage"]
    chunks = layers // (pp * int(per_virtual)) if per_virtual else 1
    layout = _megatron_layout(row, "full", chunks, grad_accumulation_bytes=MEGATRON_2021_GRAD_ACCUMULATION)
    label = f"{row['params_b']}B tp{row['tp']} pp{pp} dp{row['dp']} v{chunks}"
    return Case(
        "megatron_2021_table1", label, _gpt(row), layout, A100, float(row["tflops_per_gpu"]), "tflops_per_gpu"
    )


def _korthikanti_table5(row: dict) -> Case:
    selective = row["setting"].startswith("seq_parallel")
    layout = _megatron_layout(
        row, "selective" if selective else "full", int(row["interleave"]), tp_sp=selective
    )
    label = f"{row['model']} {'sp+selective' if selective else 'full'}"
    return Case(
        "korthikanti_2022_table5", label, _gpt(row), layout, A100, float(row["iteration_s"]), "iteration_s"
    )


@cache
def _vtrain_testbed() -> Hardware:
    return vtrain_testbed()


def _vtrain(table: str):
    def case(row: dict) -> Case:
        hardware = _vtrain_testbed()
        model = gpt_style(int(row["hidden size"]), int(row["# layers"]), int(row["attention heads"]))
        layout = _megatron_layout(
            {
                "dp": row["data parallelism"],
                "pp": row["pipeline parallelism"],
                "tp": row["tensor parallelism"],
                "micro_batch": row["micro batch"],
                "global_batch": row["global batch"],
                "seq": row["sequence length"],
            },
            "full",
            1,
        )
        label = f"h{model.hidden_size} L{model.num_layers} tp{layout.tp} pp{layout.pp} dp{layout.dp} mb{layout.micro_batch}"
        return Case(
            table, label, model, layout, hardware, float(row["iteration time (ms)"]) / 1e3, "iteration_s"
        )

    return case


def _llmfoundry(table: str, hardware: Hardware):
    """A row of llm-foundry's H100 or A100 80GB table: Composer + FSDP FULL_SHARD (ZeRO-3 over every
    GPU), bf16, flash attention, activation checkpointing as the row says."""

    def case(row: dict) -> Case:
        gpus, checkpointing = int(row["gpus"]), row["activation_checkpointing"] == "True"
        model = gpt_style(int(row["d_model"]), int(row["n_layers"]), int(row["n_heads"]), int(row["vocab"]))
        layout = Layout(
            dp=gpus,
            pp=1,
            tp=1,
            micro_batch=int(row["micro_batch"]),
            global_batch=int(row["global_batch"]),
            seq_len=int(row["seq"]),
            recompute="full" if checkpointing else "none",
            zero=3,
            flash_attention=True,
            overlap_grad_sync=True,
        )
        label = f"mpt-{row['model']} s{row['seq']} {gpus}gpu mb{row['micro_batch']}{' ac' if checkpointing else ''}"
        measured = float(row["tokens_per_s_per_gpu"])
        return Case(
            table, label, model, layout, hardware, measured, "tokens_per_s_per_gpu", "bf16", LLM_FOUNDRY
        )

    return case


TORCHTITAN = "torchtitan"
# Meta's Grand Teton hosts of torchtitan's published benchmarks (benchmarks/llama3_h100_202412_torchtitan.md):
# H100 with 96 GB of HBM2e at 2.4 TB/s, 8 per host on NVLink, 400 Gb/s RDMA per GPU, "the default
# 500W power limit" of the SXM part's 700 W TDP. The page says their peak FLOP/s lies between H100
# SXM's (989) and NVL's (835) and is not known; the power law of `hardware.power_capped` puts it at
# 989 x (500/700)^(1/3) = 884 TFLOP/s bf16 (the MAMF share measured at 700 W kept).
H100_SXM_WATTS = 700.0
GRAND_TETON_WATTS = 500.0
GRAND_TETON = power_capped(
    replace(H100, hbm_bytes=96 * GIB, hbm_bandwidth=2.4e12),
    GRAND_TETON_WATTS,
    H100_SXM_WATTS,
    "h100-grand-teton",
)
# torchtitan's optimizer step as the benchmarks ran it (`optimizer.fused` off: torch.optim.AdamW
# with foreach=True, torchtitan/optimizer.py at 9dec370) on fp32 parameters, gradients and states,
# HBM bytes per local parameter: the decoupled weight decay `param *= 1 - lr wd` (4 + 4), `m.lerp_(g)`
# (8 + 4), `v *= beta2` (4 + 4), `v.addcmul_(g, g)` (12 + 4), `sqrt(v)` (4 + 4), its division by the
# bias correction (4 + 4) and `+ eps` (4 + 4), `param.addcdiv_(m, denom)` (12 + 4): 84; and
# `clip_grad_norm_` (max_norm 1.0): the norm's read (4) and the clip's multiply (4 + 4): 96 in all.
TORCHTITAN_OPTIMIZER_BYTES = 96.0
# FSDP2 (torch.distributed._composable.fsdp, torch 1963fc8) around its collectives, HBM bytes per
# unsharded parameter per step: each all-gather's copy-out into the parameters
# (`split_with_sizes_copy`, read 2 + write 2 in bf16), twice with reshard-after-forward (forward
# and backward), and the gradients' copy-in to the fp32 reduce-scatter input (`_chunk_cat`, read 2,
# write 4): 14. (The copy-in of the local shard to the all-gather input is 1/N of a parameter.)
FSDP2_COPY_BYTES = 14.0


def _torchtitan(row: dict) -> Case:
    """A bf16 row of torchtitan's published Llama 3.1 benchmarks: FSDP2 (ZeRO-3 over the FSDP
    ranks), eager (no torch.compile, no Float8), flash SDPA, per-op selective checkpointing."""
    gpus, tp, local = int(row["gpus"]), int(row["tp"]), int(row["local_batch"])
    fsdp = int(row["fsdp"])
    layout = Layout(
        dp=fsdp,
        tp=tp,
        micro_batch=local,
        global_batch=int(row["global_batch"]),
        seq_len=int(row["seq"]),
        recompute={"selective_op": "op", "full": "full"}[row["activation_checkpointing"]],
        zero=3,
        sequence_parallel=tp > 1,
        flash_attention=True,
        overlap_grad_sync=True,
        optimizer_bytes=TORCHTITAN_OPTIMIZER_BYTES,
        zero3_copy_bytes=FSDP2_COPY_BYTES,
        # eager: its RMSNorm, RoPE, repeat_kv and SwiGLU run as separate kernels (no torch.compile)
        pointwise_bytes=eager_llama_pointwise_bytes(PRESETS[row["model"]]),
    )
    assert layout.gpus == gpus and layout.microbatches == 1, row
    label = f"{row['model']} {gpus}gpu fsdp{fsdp} tp{tp} lbs{local} ({row['techniques']})"
    return Case(
        "torchtitan_h100",
        label,
        PRESETS[row["model"]],
        layout,
        GRAND_TETON,
        float(row["tokens_per_s_per_gpu"]),
        "tokens_per_s_per_gpu",
        "bf16",
        TORCHTITAN,
    )


def mcore_v08_flops(model: ModelConfig, layout: Layout) -> float:
    """FLOPs of one step as Megatron-Core v0.8 counts them for its reported TFLOP/s
    (`num_floating_point_operations`, megatron/training/training.py): 12 B s L h^2 x (attention
    (1 + groups/heads + s/h) x q/h + MLP f/h x top-k x 3/2 (SwiGLU) + logits V / 2Lh); full (not
    causal) attention, no recompute."""
    h, s, layers = model.hidden_size, layout.seq_len, model.num_layers
    q_ratio = model.num_heads * model.head_dim / h
    attention = (1 + model.num_kv_heads / model.num_heads + s / h) * q_ratio
    top_k = model.num_experts_per_tok if model.is_moe else 1
    ffn = model.moe_intermediate_size if model.is_moe else model.intermediate_size
    mlp = ffn / h * top_k * (1.5 if model.gated_mlp else 1.0)
    logits = model.vocab_size / (2 * layers * h)
    return 12 * layout.global_batch * s * layers * h * h * (attention + mlp + logits)


def _megatron_core_moe(row: dict) -> Case:
    """A row of the Megatron-Core MoE tables on H100 (shiftlm/data/README.md): bf16, rank order
    tp-cp-ep-dp-pp, Megatron SP, TE fused attention, distributed optimizer (ZeRO-1) with overlapped
    gradient reduce, interleaved 1F1B with `vp` chunks, expert TP 1 (`etp`), dropless
    balanced routing. DeepEP's dispatch (the Qwen3 rows) sends a token once to each other node holding
    any of its experts (`moe.deepep_dispatch_bytes`); the fine-grained recompute of norms and
    activations ("norm,act") is replayed as selective (pointwise only, not priced). The host issues
    a Megatron-Core MoE layer's ops, counted from its source (`moe.megatron_core_moe_layer_ops`)."""
    model = PRESETS[row["model"]]
    pp, vp = int(row["pp"]), int(row["vp"])
    layout = Layout(
        dp=int(row["dp"]),
        pp=pp,
        tp=int(row["tp"]),
        cp=int(row["cp"]),
        ep=int(row["ep"]),
        etp=int(row["expert_tp"]),
        micro_batch=int(row["micro_batch"]),
        global_batch=int(row["global_batch"]),
        seq_len=int(row["seq"]),
        schedule="interleaved_1f1b" if vp > 1 else "1f1b",
        chunks=vp,
        recompute="selective" if row["recompute"] else "none",
        zero=1,
        sequence_parallel=int(row["tp"]) > 1,
        rank_order=MEGATRON_ORDER,
        ep_dispatcher="deepep" if row["dispatcher"] == "deepep" else "alltoall",
        megatron_core_moe=True,
    )
    assert layout.gpus == int(row["gpus"]), row
    label = f"{row['model']} {layout.gpus}gpu tp{layout.tp} ep{layout.ep} pp{pp} vp{vp} ({row['dispatcher']})"
    # a row that gives Megatron-Core's TFLOP/s only: its step time by that release's own FLOPs count
    step = float(row["step_time_s"] or 0) or mcore_v08_flops(model, layout) / (
        float(row["tflops_per_gpu"]) * 1e12 * layout.gpus
    )
    return Case("megatron_core_moe_h100", label, model, layout, H100, step, "iteration_s", "bf16")


PARSERS = {
    "megatron_2021_table1": _megatron_table1,
    "korthikanti_2022_table5": _korthikanti_table5,
    "vtrain_multi_node": _vtrain("vtrain_multi_node"),
    "vtrain_single_node": _vtrain("vtrain_single_node"),
    "llmfoundry_h100": _llmfoundry("llmfoundry_h100", H100),
    "llmfoundry_a100": _llmfoundry("llmfoundry_a100", A100),
    "torchtitan_h100": _torchtitan,
    "megatron_core_moe_h100": _megatron_core_moe,
}


def default_data_dir() -> Path:
    """The measured tables shipped inside the package (`shiftlm/data/measured`)."""
    return MEASURED_DIR


def load_cases(data_dir: Path, tables: list[str] | None = None) -> dict[str, list[Case]]:
    """Every row of every measured table (or of `tables`), as cases."""
    if not data_dir.is_dir():
        raise ValueError(f"measured data directory {data_dir} not found; pass --data DIR")
    cases = {}
    for table in tables or list(TABLES):
        path = data_dir / TABLES[table]
        if not path.exists():
            raise ValueError(f"{path} is missing; --data must hold the measured/*.csv tables")
        with path.open() as handle:
            cases[table] = [PARSERS[table](row) for row in csv.DictReader(handle)]
    return cases
