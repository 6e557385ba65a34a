"""`shiftlm serve`'s flags checked alone, before the checkpoint is read: each wrong one is a
ConfigError (a Hub id for MODEL a CheckpointError) naming the flag and the fix, exit 2 (3)."""

from __future__ import annotations

import re
from pathlib import Path

from shiftlm.errors import CheckpointError, ConfigError
from shiftlm.serve.http.reasoning import REASONING_PARSERS
from shiftlm.serve.http.tool_parsers import TOOL_CALL_PARSERS
from shiftlm.serve.plan import MODE_NAMES
from shiftlm.serve.worker import ATTENTION_BACKENDS

DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "float16": "float16", "half": "float16"}  # fmt: skip


def check_flags(flags) -> None:
    """`flags`: a `ServeOptions`."""
    if flags.tp < 1 or flags.sp < 1:
        raise ConfigError("--tp and --sp must be >= 1")
    for name, value in (("MODEL", flags.model), ("--tokenizer", flags.tokenizer)):
        if value is not None and looks_like_hub_id(value):
            raise CheckpointError(
                f"{name} {value!r} looks like a Hugging Face Hub id; shiftlm does not download "
                f"models: fetch it first (huggingface-cli download {value} --local-dir DIR) and pass "
                "the local directory"
            )
    if flags.kv_cache_dtype != "auto":
        raise ConfigError(
            f"--kv-cache-dtype {flags.kv_cache_dtype!r} is not supported: the KV cache always has "
            "the weights' dtype (--dtype); use --kv-cache-dtype auto or leave it out"
        )
    if flags.enable_auto_tool_choice and flags.tool_call_parser is None:
        raise ConfigError(
            "--enable-auto-tool-choice needs --tool-call-parser: one of " + ", ".join(TOOL_CALL_PARSERS)
        )
    choices = [
        ("--tool-call-parser", flags.tool_call_parser, (None, *TOOL_CALL_PARSERS)),
        ("--reasoning-parser", flags.reasoning_parser, (None, *REASONING_PARSERS)),
        ("--scheduling-policy", flags.scheduling_policy, ("fcfs", "priority")),
        ("--mode", flags.mode, MODE_NAMES),
        ("--attention-backend", flags.attention_backend, ATTENTION_BACKENDS),
        ("--dtype", flags.dtype, DTYPES),
    ]
    for flag, value, allowed in choices:
        if value not in allowed:
            named = ", ".join(str(choice) for choice in allowed if choice is not None)
            raise ConfigError(f"{flag} {value!r} is not one of {named}")
    for name in ("rank_timeout", "step_timeout", "max_request_bytes", "header_timeout", "body_timeout"):
        if getattr(flags, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= flags.spin_wait <= 1:
        raise ConfigError(f"--spin-wait {flags.spin_wait} must be in [0, 1] seconds (0: never poll)")
    if flags.max_connections is not None and flags.max_connections < 1:
        raise ConfigError("--max-connections must be >= 1")
    for name in ("max_pending", "max_num_seqs", "max_tokens_per_step", "block_size"):
        if getattr(flags, name) < 1:
            flag = f"--{name.replace('_', '-')}"  # vLLM's name for the step's budget:
            flag = "--max-num-batched-tokens" if name == "max_tokens_per_step" else flag
            raise ConfigError(f"{flag} {getattr(flags, name)} must be >= 1")
    for size in flags.cuda_graph_sizes:
        if not 1 <= size <= flags.max_num_seqs:
            raise ConfigError(
                f"--cuda-graph-sizes {size} is outside 1..--max-num-seqs {flags.max_num_seqs}: a decode "
                "step never holds more sequences; lower it or raise --max-num-seqs"
            )
    if flags.shift_threshold != "auto" and not (
        isinstance(flags.shift_threshold, int) and flags.shift_threshold >= 0
    ):
        raise ConfigError(f"--shift-threshold {flags.shift_threshold!r} must be a token count >= 0 or auto")
    if not 0 <= flags.port <= 65535:
        raise ConfigError(f"--port {flags.port} must be in [0, 65535] (0: a free port, printed)")
    for name in ("log_interval", "shutdown_timeout"):
        if getattr(flags, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(flags, name)} must be >= 0")
    if flags.timeout_keep_alive <= 0:
        raise ConfigError(f"--timeout-keep-alive {flags.timeout_keep_alive} must be > 0")
    if not 0 < flags.gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization {flags.gpu_memory_utilization} must be in (0, 1]")
    if flags.num_blocks is not None and flags.num_blocks < 1:
        raise ConfigError("--num-blocks must be >= 1")
    if flags.speculative() is not None and flags.async_scheduling:
        raise ConfigError(
            "--speculative-config and --async-scheduling cannot be combined: a step's drafts "
            "follow the tokens the previous step kept; drop one of them"
        )


def looks_like_hub_id(model: str) -> bool:
    """`org/name` that is not a local path: what vLLM would download from the Hugging Face Hub."""
    return not Path(model).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", model) is not None
