"""`shiftlm verify`: check that TP x SP x CP layouts compute what Hugging Face `transformers` computes.

    shiftlm verify                                   # a tiny built-in llama (GQA), several layouts
    shiftlm verify --model ./my-llama --tp 1,2 --sp 1,2 --json
    shiftlm verify --cp 1,2 --sp 1,2                 # context parallelism (ring attention) with Ulysses

For each layout it starts tp*sp*cp local gloo ranks on the CPU, runs a fixed batch forward and backward
in fp32, and compares the logits and the loss gradient of the input embeddings with `transformers`
on the same checkpoint. Exit code 1 if any layout is above the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

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
    parser.add_argument("--tp", type=_int_list, help="tensor-parallel degrees, e.g. 1,2,4")
    parser.add_argument("--sp", type=_int_list, help="Ulysses sequence-parallel degrees, e.g. 1,2")
    parser.add_argument("--cp", type=_int_list, help="context-parallel (ring attention) degrees, e.g. 1,2")
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="Megatron sequence-parallel norm regions"
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument(
        "--tolerance", type=float, default=1e-5, help="max relative error (max|diff| / max|ref|)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=run)


def _layouts(args) -> list[tuple[int, int, int]]:
    """(tp, sp, cp) triples: the product of the given degrees, or the default TP x SP set."""
    if args.tp is None and args.sp is None and args.cp is None:
        return [(tp, sp, 1) for tp, sp in DEFAULT_LAYOUTS]
    return [(tp, sp, cp) for cp in (args.cp or [1]) for tp in (args.tp or [1]) for sp in (args.sp or [1])]


def run(args) -> int:
    import transformers

    from shiftlm.config import ModelConfig, ParallelConfig
    from shiftlm.launch import LocalWorkers, WorkerError
    from shiftlm.model.parity import layout_outputs, reference_outputs, relative_error
    from shiftlm.model.tiny import make_tiny_checkpoint
    from shiftlm.model.weights import check_checkpoint_files

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model_dir = args.model
    if model_dir is None:
        model_dir = str(make_tiny_checkpoint(tempfile.mkdtemp(prefix="shiftlm-verify-"), "llama-gqa"))
    layouts = _layouts(args)
    # user errors (ConfigError and its subclasses) reach `shiftlm.cli.main`: one line and their exit code
    config = ModelConfig.from_hf(model_dir)
    check_checkpoint_files(model_dir)
    for tp, sp, cp in layouts:
        parallel = ParallelConfig(tp=tp, sp=sp, cp=cp, sequence_parallel=args.sequence_parallel)
        parallel.check_model(config)
        parallel.check_sequence(args.seq_len)

    log = sys.stderr if args.json else sys.stdout
    print(f"reference: transformers {transformers.__version__} on {model_dir}", file=log)
    reference = reference_outputs(model_dir, args.batch, args.seq_len)
    rows = []
    for tp, sp, cp in layouts:
        start = time.perf_counter()
        name = f"tp={tp} sp={sp}" + (f" cp={cp}" if cp > 1 else "")
        try:
            with LocalWorkers(tp * sp * cp) as workers:
                ours = workers.run(
                    layout_outputs,
                    model_dir,
                    tp=tp,
                    sp=sp,
                    cp=cp,
                    sequence_parallel=args.sequence_parallel,
                    batch=args.batch,
                    seq_len=args.seq_len,
                )[0]
        except WorkerError as err:
            print(f"shiftlm verify: layout {name} failed:\n{err}", file=sys.stderr)
            return 1
        logits_abs, logits_rel = relative_error(ours.logits, reference.logits)
        grad_abs, grad_rel = relative_error(ours.embedding_grad, reference.embedding_grad)
        rows.append(
            {
                "tp": tp,
                "sp": sp,
                "cp": cp,
                "ranks": tp * sp * cp,
                "logits_max_abs": logits_abs,
                "logits_max_rel": logits_rel,
                "embedding_grad_max_abs": grad_abs,
                "embedding_grad_max_rel": grad_rel,
                "ok": max(logits_rel, grad_rel) <= args.tolerance,
                "seconds": round(time.perf_counter() - start, 2),
            }
        )
        row = rows[-1]
        print(
            f"{name}: logits abs {logits_abs:.2e} rel {logits_rel:.2e} | "
            f"input-grad abs {grad_abs:.2e} rel {grad_rel:.2e} | {'ok' if row['ok'] else 'FAIL'} "
            f"({row['seconds']}s)",
            file=log,
            flush=True,
        )
    passed = all(r["ok"] for r in rows)
    if args.json:
        print(
            json.dumps({"model": model_dir, "tolerance": args.tolerance, "passed": passed, "layouts": rows})
        )
    else:
        print(f"{'all layouts match' if passed else 'MISMATCH'} (tolerance {args.tolerance:g} relative)")
    return 0 if passed else 1
