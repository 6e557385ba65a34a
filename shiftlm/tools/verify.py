"""`shiftlm verify`: check that TP x SP x CP (x EP) layouts compute what Hugging Face `transformers` computes.

    shiftlm verify                                   # a tiny built-in llama (GQA), several layouts
    shiftlm verify --model ./my-llama --tp 1,2 --sp 1,2 --json
    shiftlm verify --cp 1,2 --sp 1,2                 # context parallelism (ring attention) with Ulysses
    shiftlm verify --device cuda --dtype bfloat16    # on a GPU, in training's bf16 autocast
    shiftlm verify --tiny mixtral --ep 1,2,4 --tp 1,2    # mixture of experts, expert parallel
    shiftlm verify --tiny qwen2-moe --ep 2 --tp 2 --etp 1  # experts whole, attention over tp 2

For each layout it starts tp*sp*cp local ranks (gloo on the CPU; NCCL with one GPU per rank under
--device cuda, a one-rank layout in this process), runs a fixed batch forward and backward, and compares
the logits and the loss gradient of the input embeddings with `transformers` on the same checkpoint and
device. With --ep E, E data-parallel ranks each hold a slice of the batch and 1/E of the experts
(tokens reach their experts by all-to-all); the batch is then at least E sequences. With --etp T' (the
experts' own TP size, not tp), ep x etp / tp data-parallel ranks hold the batch. In fp32 the relative error must be within --tolerance. In bf16 (autocast over fp32 weights, as
training runs on GPUs) both shiftlm and `transformers` are compared with `transformers` in fp32, and
shiftlm's error must be within --bf16-slack times transformers' own bf16 error. Exit code 1 if any
layout fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from shiftlm.tools.tiny import TINY_FAMILIES

DEFAULT_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check TP x SP x CP layouts against Hugging Face transformers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", help="HF checkpoint directory (default: a tiny built-in llama with GQA)")
    parser.add_argument(
        "--tiny",
        default="llama-gqa",
        choices=TINY_FAMILIES,
        help="without --model: the family of the tiny checkpoint written with transformers (default llama-gqa)",
    )
    parser.add_argument("--tp", type=_int_list, help="tensor-parallel degrees, e.g. 1,2,4")
    parser.add_argument("--sp", type=_int_list, help="Ulysses sequence-parallel degrees, e.g. 1,2")
    parser.add_argument("--cp", type=_int_list, help="context-parallel (ring attention) degrees, e.g. 1,2")
    parser.add_argument(
        "--ep",
        type=_int_list,
        help="expert-parallel degrees (mixture-of-experts models), each over that many data-parallel ranks",
    )
    parser.add_argument(
        "--etp",
        type=_int_list,
        help="the experts' own tensor-parallel degrees (default: tp), each over ep x etp / tp data-parallel ranks",
    )
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="Megatron sequence-parallel norm regions"
    )
    parser.add_argument(
        "--batch", type=int, help="sequences in the random input batch (default: 2, or the largest ep)"
    )
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence of the input batch")
    parser.add_argument(
        "--tolerance", type=float, default=1e-5, help="max relative error (max|diff| / max|ref|)"
    )
    parser.add_argument(
        "--device", default="auto", help="auto (a GPU when CUDA is visible, else the CPU), cuda or cpu"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="float32, or bfloat16 autocast over fp32 weights (training's GPU precision)",
    )
    parser.add_argument(
        "--bf16-slack",
        type=float,
        default=2.0,
        help="with --dtype bfloat16: shiftlm's error vs fp32 may be this many times transformers' own",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=run)


def _layouts(args) -> list[tuple[int, int, int, int, int]]:
    """(tp, sp, cp, ep, etp) tuples: the product of the given degrees, or the default TP x SP set."""
    if args.tp is None and args.sp is None and args.cp is None and args.ep is None and args.etp is None:
        return [(tp, sp, 1, 1, 0) for tp, sp in DEFAULT_LAYOUTS]
    return [
        (tp, sp, cp, ep, etp)
        for ep in (args.ep or [1])
        for etp in (args.etp or [0])
        for cp in (args.cp or [1])
        for tp in (args.tp or [1])
        for sp in (args.sp or [1])
    ]


def _ranks(tp: int, sp: int, cp: int, ep: int, etp: int) -> int:
    from shiftlm.tools.parity import data_ranks

    return tp * sp * cp * data_ranks(tp, ep, etp)


def _judged(ours, reference, hf_bf16, args) -> tuple[dict, str]:
    """One layout's errors against transformers' fp32 outputs, whether they pass (fp32: the tolerance;
    bf16: a multiple of transformers' own bf16 error), and the line that says so."""
    from shiftlm.tools.parity import relative_error

    logits_abs, logits_rel = relative_error(ours.logits, reference.logits)
    grad_abs, grad_rel = relative_error(ours.embedding_grad, reference.embedding_grad)
    row = {
        "logits_max_abs": logits_abs,
        "logits_max_rel": logits_rel,
        "embedding_grad_max_abs": grad_abs,
        "embedding_grad_max_rel": grad_rel,
    }
    line = (
        f"logits abs {logits_abs:.2e} rel {logits_rel:.2e} | input-grad abs {grad_abs:.2e} rel {grad_rel:.2e}"
    )
    if hf_bf16 is None:
        row["ok"] = max(logits_rel, grad_rel) <= args.tolerance
        return row, line
    hf_logits = relative_error(hf_bf16.logits, reference.logits)[1]
    hf_grad = relative_error(hf_bf16.embedding_grad, reference.embedding_grad)[1]
    row["transformers_bf16_logits_max_rel"] = hf_logits
    row["transformers_bf16_embedding_grad_max_rel"] = hf_grad
    row["ok"] = logits_rel <= args.bf16_slack * hf_logits and grad_rel <= args.bf16_slack * hf_grad
    return row, f"{line} (transformers bf16: logits {hf_logits:.2e}, input-grad {hf_grad:.2e})"


def run(args) -> int:
    import torch
    import transformers

    from shiftlm.config import ModelConfig
    from shiftlm.launch import Pools, WorkerError
    from shiftlm.mesh import check_dtype, choose_device, device_name, visible_gpus
    from shiftlm.model.weights import check_checkpoint_files
    from shiftlm.parallel import ParallelConfig
    from shiftlm.tools.parity import (
        check_batch,
        data_ranks,
        layout_outputs,
        reference_outputs,
    )
    from shiftlm.tools.tiny import make_tiny_checkpoint

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model_dir = args.model
    if model_dir is None:
        model_dir = str(make_tiny_checkpoint(tempfile.mkdtemp(prefix="shiftlm-verify-"), args.tiny))
    layouts = _layouts(args)
    if args.tp is None and args.sp is None and args.cp is None and args.device != "cpu" and visible_gpus():
        # the default set, cut to the layouts this node's GPUs can run (one rank per GPU)
        layouts = [layout for layout in layouts if _ranks(*layout) <= visible_gpus()]
    batch = args.batch or max(2, *(data_ranks(tp, ep, etp) for tp, _, _, ep, etp in layouts))
    # user errors (ConfigError and its subclasses) reach `shiftlm.cli.main`: one line and their exit code
    config = ModelConfig.from_hf(model_dir)
    check_checkpoint_files(model_dir)
    most_ranks = max(_ranks(*layout) for layout in layouts)
    device, backend = choose_device(args.device, local_world=most_ranks if args.device != "cpu" else None)
    bf16 = args.dtype == "bfloat16"
    if bf16:
        check_dtype(device, torch.bfloat16)
    for tp, sp, cp, ep, etp in layouts:  # every layout checked before any rank starts
        dp = data_ranks(tp, ep, etp)
        parallel = ParallelConfig(
            dp=dp, tp=tp, sp=sp, cp=cp, sequence_parallel=args.sequence_parallel, ep=ep, etp=etp
        )
        parallel.check_model(config)
        parallel.check_sequence(args.seq_len)
        check_batch(batch, dp)

    log = sys.stderr if args.json else sys.stdout
    where = device_name(device)
    print(
        f"reference: transformers {transformers.__version__} on {model_dir} ({where}, {args.dtype})", file=log
    )
    reference = reference_outputs(model_dir, batch, args.seq_len, device=str(device))
    # bf16: transformers' own bf16 error against its fp32 is the scale shiftlm's error is judged by
    hf_bf16 = (
        reference_outputs(model_dir, batch, args.seq_len, device=str(device), autocast=True) if bf16 else None
    )
    rows = []
    with Pools(backend=backend) as pools:  # one per rank count: a process group starts once
        for tp, sp, cp, ep, etp in layouts:
            start = time.perf_counter()
            ranks = _ranks(tp, sp, cp, ep, etp)
            name = f"tp={tp} sp={sp}" + (f" cp={cp}" if cp > 1 else "") + (f" ep={ep}" if ep > 1 else "")
            name += f" etp={etp} (dp={data_ranks(tp, ep, etp)})" if etp not in (0, tp) else ""
            kwargs = dict(
                tp=tp,
                sp=sp,
                cp=cp,
                ep=ep,
                etp=etp,
                sequence_parallel=args.sequence_parallel,
                batch=batch,
                seq_len=args.seq_len,
                autocast=bf16,
            )
            try:
                if device.type == "cuda" and ranks == 1:  # one GPU: this process, no process group
                    ours = layout_outputs(model_dir, device=str(device), **kwargs)
                else:
                    ours = pools.run(ranks, layout_outputs, model_dir, **kwargs)[0]
            except WorkerError as err:
                print(f"shiftlm verify: layout {name} failed:\n{err}", file=sys.stderr)
                return 1
            row, judged = _judged(ours, reference, hf_bf16, args)
            row = {"tp": tp, "sp": sp, "cp": cp, "ep": ep, "etp": etp or tp, "ranks": ranks, **row}
            row["seconds"] = round(time.perf_counter() - start, 2)
            rows.append(row)
            print(
                f"{name}: {judged} | {'ok' if row['ok'] else 'FAIL'} ({row['seconds']}s)",
                file=log,
                flush=True,
            )
    passed = all(r["ok"] for r in rows)
    rule = (
        f"within {args.bf16_slack:g}x transformers' own bf16 error vs fp32"
        if bf16
        else f"tolerance {args.tolerance:g} relative"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "model": model_dir,
                    "device": where,
                    "dtype": args.dtype,
                    "tolerance": args.tolerance,
                    "rule": rule,
                    "passed": passed,
                    "layouts": rows,
                }
            )
        )
    else:
        print(f"{'all layouts match' if passed else 'MISMATCH'} ({rule})")
    return 0 if passed else 1
