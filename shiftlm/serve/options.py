"""The options of `shiftlm serve`, named as vLLM names them, and their checks before any rank starts."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

from shiftlm.config import ConfigError, ParallelConfig

DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "float16": "float16", "half": "float16"}  # fmt: skip
API_KEY_ENV = "SHIFTLM_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    model: str
    tp: int = 1
    sp: int = 1
    mode: str = "shift"
    shift_threshold: int | str = "auto"  # auto: measured at startup (serve/shift_probe.py)
    num_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 64
    max_tokens_per_step: int = 256
    max_pending: int = 512
    enforce_eager: bool = False  # every step eager (default: small decode steps compiled, compiled_step.py)
    attention_backend: str = "auto"  # auto | cpu-kernel | sdpa (runner.ATTENTION_BACKENDS)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    step_log: str | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    chat_template: str | None = None
    seed: int | None = None
    api_key: str | None = None
    max_request_bytes: int = 16 * 2**20
    rank_timeout: float = 10.0
    step_timeout: float = 60.0
    shutdown_timeout: float = 5.0
    log_interval: float = 10.0
    cpu_bind: str = "auto"  # auto: local rank r on the r-th core this process may use; none
    spin_wait: float = 0.0  # CPU worker ranks poll a collective this long before sleeping (comm/wait.py)
    # connections (serve/uvicorn_server.py): None = as many as the open-file limit allows
    max_connections: int | None = None
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    timeout_keep_alive: float = 5.0
    # vLLM's flags
    enable_prefix_caching: bool = True
    disable_log_requests: bool = False  # no access-log line per request
    tokenizer: str | None = None  # a tokenizer directory other than the model's
    trust_remote_code: bool = False  # accepted: shiftlm never runs a checkpoint's code
    kv_cache_dtype: str = "auto"  # only auto: the cache has the weights' dtype

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__ if hasattr(args, name)})

    @property
    def parallel(self) -> ParallelConfig:
        """The layout --tensor-parallel-size / --sequence-parallel-size name, as the core's type."""
        return ParallelConfig(tp=self.tp, sp=self.sp)

    def torch_dtype(self, device_type: str = "cpu") -> str:
        """The weights' and cache's dtype; `auto` is bfloat16 on a GPU, float32 on the CPU (the
        CPU/gloo engine's parity dtype)."""
        dtype = DTYPES[self.dtype]
        return ("bfloat16" if device_type == "cuda" else "float32") if dtype == "auto" else dtype

    def engine_device(self, under_torchrun: bool):
        """This rank's device (`mesh.choose_device`): --device checked against what is visible; the
        local ranks `shiftlm serve` starts itself (tp*sp) all sit on this node."""
        from shiftlm.mesh import choose_device

        return choose_device(self.device, None if under_torchrun else self.tp * self.sp)[0]

    def context_length(self, max_position_embeddings: int) -> int:
        """--max-model-len, or what the model and the KV cache allow."""
        fits = min(max_position_embeddings, self.num_blocks * self.block_size)
        return self.max_model_len if self.max_model_len is not None else fits

    def served_name(self) -> str:
        from shiftlm.serve.server import default_served_name

        return self.served_model_name or default_served_name(self.model)

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None

    def chat_template_text(self) -> str | None:
        """--chat-template: a file's contents, or the template itself (as vLLM reads it)."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        if path.is_file():
            return path.read_text()
        if "{" not in self.chat_template:
            raise ConfigError(
                f"--chat-template {self.chat_template!r} is neither a file nor a Jinja template"
            )
        return self.chat_template

    def check(self):
        """Fail before any process starts: the checkpoint, the layout, the limits, the tokenizer and
        the chat template. Returns the tokenizer."""
        from shiftlm.config import CheckpointError, ModelConfig
        from shiftlm.serve.tokenizer import load_tokenizer

        if self.tp < 1 or self.sp < 1:
            raise ConfigError("--tp and --sp must be >= 1")
        for name, value in (("MODEL", self.model), ("--tokenizer", self.tokenizer)):
            if value is not None and looks_like_hub_id(value):
                raise CheckpointError(
                    f"{name} {value!r} looks like a Hugging Face Hub id; shiftlm does not download "
                    f"models: fetch it first (huggingface-cli download {value} --local-dir DIR) and pass "
                    "the local directory"
                )
        if self.kv_cache_dtype != "auto":
            raise ConfigError(
                f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported: the KV cache always has "
                "the weights' dtype (--dtype); use --kv-cache-dtype auto or leave it out"
            )
        config = ModelConfig.from_hf(self.model)
        self.parallel.check_model(config)
        if config.is_moe:
            raise ConfigError(
                f"{self.model} is a mixture-of-experts model ({config.model_type}), which shiftlm does not "
                "serve yet (docs/moe.md): serve a dense llama, qwen2 or mistral checkpoint"
            )
        if self.mode not in ("tp", "sp_tp", "shift"):
            raise ConfigError(f"--mode {self.mode!r} is not one of tp, sp_tp, shift")
        if self.attention_backend not in ("auto", "cpu-kernel", "sdpa"):
            raise ConfigError(
                f"--attention-backend {self.attention_backend!r} is not one of auto, cpu-kernel, sdpa"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        import torch

        from shiftlm.mesh import check_dtype

        device = self.engine_device("RANK" in os.environ and "WORLD_SIZE" in os.environ)
        check_dtype(device, getattr(torch, self.torch_dtype(device.type)))
        fits = min(config.max_position_embeddings, self.num_blocks * self.block_size)
        if self.max_model_len is not None and not 1 < self.max_model_len <= fits:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} must be in [2, {fits}] (the model's "
                f"{config.max_position_embeddings} positions and the cache's {self.num_blocks} x "
                f"{self.block_size} tokens); raise --num-blocks for more"
            )
        for name in ("rank_timeout", "step_timeout", "max_request_bytes", "header_timeout", "body_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if not 0 <= self.spin_wait <= 1:
            raise ConfigError(f"--spin-wait {self.spin_wait} must be in [0, 1] seconds (0: never poll)")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError("--max-connections must be >= 1")
        if self.max_pending < 1:
            raise ConfigError("--max-pending must be >= 1")
        tokenizer = load_tokenizer(self.tokenizer or self.model)
        template = self.chat_template_text()
        if template is not None:
            try:
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi"}],
                    tokenize=False,
                    add_generation_prompt=True,
                    chat_template=template,
                )
            except Exception as err:  # noqa: BLE001 - Jinja's own message, as one line
                raise ConfigError(f"--chat-template does not render: {type(err).__name__}: {err}") from None
        return tokenizer


def looks_like_hub_id(model: str) -> bool:
    """`org/name` that is not a local path: what vLLM would download from the Hugging Face Hub."""
    return not Path(model).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", model) is not None
