"""`shiftlm serve` (OpenAI-compatible server) and `shiftlm bench serve` (trace replay).

    shiftlm serve DIR --tensor-parallel-size 2 --sp 1 --shift-threshold 64 --port 8000 [--api-key KEY]
    shiftlm bench serve --trace azure_code --url http://127.0.0.1:8000 \\
        --max-requests 100 --rate 2 --max-input 256 --max-output 32 --json
"""

from __future__ import annotations

import argparse
import sys

from shiftlm.errors import ConfigError, error_line
from shiftlm.serve.plan import MODE_NAMES
from shiftlm.serve.worker import ATTENTION_BACKENDS


def _serve(args: argparse.Namespace) -> int:
    from shiftlm.extras import require
    from shiftlm.serve.options import ServeOptions
    from shiftlm.serve.server import run_server

    require("serve")

    if args.model_positional and args.model and args.model_positional != args.model:
        return _fail(f"two models given ({args.model_positional!r} and --model {args.model!r}); give one")
    args.model = args.model_positional or args.model
    if not args.model:
        return _fail("give the model directory: shiftlm serve DIR (or --model DIR)")
    try:
        return run_server(ServeOptions.from_args(args))
    except ConfigError as err:  # exit code by kind: 2 flags, 3 checkpoint (shiftlm.errors)
        return _fail(str(err), err.exit_code)


def _bench_serve(args: argparse.Namespace) -> int:
    from shiftlm.serve.replay import run_bench

    try:
        return run_bench(args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        return _fail(str(err), command="bench")


def _fail(message: str, code: int = 2, command: str = "serve") -> int:
    print(error_line(command, message), file=sys.stderr)
    return code


def add_serve_arguments(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    """The engine options, shared by `serve` and `bench serve --model` (which starts its own server)."""
    parser.add_argument("--model", required=False, help="Hugging Face checkpoint directory (with tokenizer)")
    parser.add_argument(
        "--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="tensor-parallel degree"
    )
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree")
    parser.add_argument(
        "--mode",
        default="shift",
        choices=MODE_NAMES,
        help="pin full TP or SP x TP, or shift per step (default)",
    )
    parser.add_argument(
        "--shift-threshold",
        type=_threshold,
        default="auto",
        help="full TP when a step schedules at most this many tokens, else SP x TP; auto: measured at "
        "startup on the model (the largest step size where full TP is still faster, ~1-3 s)",
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV-cache blocks per rank (default: 256 on the CPU; on a GPU, what --gpu-memory-utilization leaves)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of each GPU's memory for the weights, a step's activations and the KV cache",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one step")
    parser.add_argument(
        "--max-tokens-per-step",
        "--max-num-batched-tokens",
        dest="max_tokens_per_step",
        type=int,
        default=256,
        help="token budget of one step (vLLM's --max-num-batched-tokens)",
    )
    parser.add_argument(
        "--max-pending",
        type=int,
        default=512,
        help="requests in flight (admitted, not finished) before 429 with Retry-After",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of equal prompt prefixes (SHA-256 block hashes, tokens compared)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly; by default one rank compiles its decode steps of 1-2 sequences "
        "with torch.compile at startup (~20 s), ~15%% faster per step (docs/serving.md)",
    )
    parser.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=(),
        metavar="N",
        help="decode batch sizes captured as CUDA graphs (vLLM's flag): one N gives 1, 2, 4, then steps "
        "of 8 up to N; several give exactly those; default: that pattern up to --max-num-seqs. Larger "
        "batches run compiled without a graph",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule each step while the previous one runs, its tokens read on the device (vLLM's "
        "flag); off by default until measured on a GPU (docs/serving.md)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="auto: the model's generation_config.json sets the defaults of the sampling parameters a "
        "request leaves out (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) and "
        "adds its eos_token_id; vllm: ignore it; a directory: that one's file (vLLM's flag)",
    )
    parser.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="set or override those defaults, e.g. '{\"temperature\": 0.5}' (vLLM's flag)",
    )
    parser.add_argument(
        "--scheduling-policy",
        default="fcfs",
        help="fcfs (arrival order) or priority (a request's `priority`, lower first, then arrival; "
        "the least urgent is preempted first), as vLLM's flag",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s flag: \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' drafts each decode\'s next tokens from the '
        'latest earlier occurrence of its last n tokens and verifies them in one step; \'{"method": '
        "\"suffix\"}' drafts from suffix trees of the request and of earlier outputs (ArcticInference's "
        "suffix decoding, vLLM's suffix_decoding_* keys). The output is unchanged: docs/serving.md",
    )
    parser.add_argument(
        "--structured-outputs-any-whitespace",
        action="store_true",
        help="let structured JSON outputs put any whitespace between tokens (vLLM's default); by "
        "default their separators are ', ' and ': ' and nothing else, so that a small model cannot "
        "spend max_tokens on newlines (docs/serving.md)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let requests with tools use tool_choice "auto" (the default when tools are sent): the '
        "model's reply is parsed for tool calls by --tool-call-parser (vLLM's flags; docs/serving.md)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how tool calls are written in the model's replies: hermes (Hermes, Qwen2.5, Qwen3: "
        "<tool_call>{...}</tool_call>), llama3_json (Llama 3.1-3.3's JSON calls), mistral "
        "([TOOL_CALLS]...) or pythonic (Llama 3.2 and 4: [f(x=1), g()])",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split a reasoning model's thinking (before </think>) into reasoning_content (vLLM's flag): "
        "deepseek_r1 (the prompt opens <think>: DeepSeek-R1 and distills, QwQ, Qwen3 *-Thinking-2507) "
        "or qwen3 (the model writes <think> itself)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto = shiftlm's CPU kernels on CPU where they build (decode attention from the cache blocks, "
        "fused RMSNorm and SwiGLU; first build ~25 s, cached), else PyTorch's ops (gather + SDPA); "
        "cpu-kernel insists on them; sdpa never uses them; flex attends decode steps with PyTorch's "
        "FlexAttention straight from the cache blocks (compiled; the candidate for CUDA, docs/serving.md)",
    )


def _threshold(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count or auto, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a token count >= 0 or auto, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible server with Shift Parallelism",
        description="OpenAI-compatible server (vLLM's flags) with Shift Parallelism.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "model_positional", nargs="?", metavar="MODEL", help="checkpoint directory (as --model)"
    )
    add_serve_arguments(serve)
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: what the model and cache hold)",
    )
    serve.add_argument(
        "--dtype",
        default="auto",
        help="weights and KV cache: auto (bfloat16 on GPUs, float32 on the CPU), float32, bfloat16, float16",
    )
    serve.add_argument(
        "--device",
        default="auto",
        help="auto (GPU LOCAL_RANK + NCCL when CUDA is visible), cuda, or cpu (gloo)",
    )
    serve.add_argument("--seed", type=int, default=None, help="seed of unseeded sampling (per process)")
    serve.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the model directory's own)"
    )
    serve.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines; has no effect: shiftlm runs only its own model code",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="only auto: the KV cache has the weights' dtype (--dtype); fp8 caches are not implemented",
    )
    serve.add_argument(
        "--disable-log-requests", action="store_true", help="no access-log line per request (vLLM's flag)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one (printed)")
    serve.add_argument(
        "--step-log", default=None, help="write one JSON line per engine step (mode, tokens, seconds) here"
    )
    serve.add_argument(
        "--served-model-name",
        "--model-name",
        dest="served_model_name",
        default=None,
        help="name in /v1/models (default: config.json's _name_or_path, else MODEL as given)",
    )
    serve.add_argument(
        "--chat-template", default=None, help="Jinja chat template: a file or the template itself"
    )
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or set SHIFTLM_API_KEY)"
    )
    serve.add_argument(
        "--max-request-bytes", type=int, default=16 * 2**20, help="largest request body (413 above)"
    )
    serve.add_argument(
        "--rank-timeout",
        type=float,
        default=10.0,
        help="seconds without a worker heartbeat before it counts as stalled",
    )
    serve.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        help="seconds an engine step may run before a rank counts as stalled",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="on SIGINT/SIGTERM, seconds to drain in-flight requests",
    )
    serve.add_argument(
        "--log-interval", type=float, default=10.0, help="seconds between throughput log lines (0: none)"
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open HTTP connections at most (default: what the open-file limit allows, raised to its "
        "hard limit at startup); past it the oldest connection still waiting for its request's headers "
        "is closed, or, when all are busy, the new one gets a fast 503",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers before it is closed",
    )
    serve.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds a request body may stall before a 408"
    )
    serve.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open (uvicorn's flag)",
    )
    serve.add_argument(
        "--cpu-bind",
        choices=("auto", "none"),
        default="auto",
        help="CPU ranks: auto pins local rank r to the r-th allowed core when there are enough; none",
    )
    serve.add_argument(
        "--spin-wait",
        type=float,
        default=0.0,
        help="CPU ranks > 0: seconds a collective is polled (yielding the core) before the rank sleeps "
        "in it; only with a core of their own, and only where the shared-memory collectives are off "
        "(SHIFTLM_SHM_COLLECTIVES=0 or ranks on several hosts; default 0: never poll)",
    )
    serve.set_defaults(func=_serve)

    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    replay = bench_commands.add_parser("serve", help="replay a request trace against a server")
    replay.add_argument(
        "--trace", required=True, help="Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or JSONL"
    )
    replay.add_argument("--url", default="http://127.0.0.1:8000", help="server to replay against")
    add_serve_arguments(replay, model_required=False)  # with --model: start a local server instead
    replay.add_argument(
        "--served-model-name",
        "--model-name",
        dest="model_name",
        default=None,
        help="model name to send (default: the server's first)",
    )
    replay.add_argument("--start", type=int, default=0, help="first trace row to replay")
    replay.add_argument("--max-requests", type=int, default=100, help="replay at most this many requests")
    replay.add_argument("--time-scale", type=float, default=1.0, help="multiply inter-arrival gaps by this")
    replay.add_argument("--rate", type=float, default=None, help="rescale arrivals to this many requests/s")
    replay.add_argument("--max-input", type=int, default=512, help="clip prompt lengths to this")
    replay.add_argument("--max-output", type=int, default=64, help="clip output lengths to this")
    # the SLOs in ms, spelled as `simulate serve` and `plan serve` spell them (stored in seconds);
    # --slo-ttft / --slo-tpot (seconds) are the older spelling, kept
    milliseconds = lambda text: float(text) / 1000  # noqa: E731
    replay.add_argument(
        "--slo-ttft-ms",
        dest="slo_ttft",
        type=milliseconds,
        default=2.0,
        help="TTFT SLO in ms for goodput (default: 2000)",
    )
    replay.add_argument(
        "--slo-tpot-ms",
        dest="slo_tpot",
        type=milliseconds,
        default=0.2,
        help="TPOT SLO in ms for goodput (default: 200)",
    )
    replay.add_argument(
        "--slo-ttft", type=float, default=argparse.SUPPRESS, help="TTFT SLO in seconds (older spelling)"
    )
    replay.add_argument(
        "--slo-tpot", type=float, default=argparse.SUPPRESS, help="TPOT SLO in seconds (older spelling)"
    )
    replay.add_argument("--timeout", type=float, default=300.0, help="give up on the whole replay after this")
    replay.add_argument("--out", default=None, help="directory for results.json and PNG plots")
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    replay.set_defaults(func=_bench_serve)
