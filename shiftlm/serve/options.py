"""The options of `shiftlm serve`, named as vLLM names them, resolved and checked once before any
rank starts.

    setup = ServeOptions.from_args(args).resolve()   # ConfigError (exit 2/3) on anything wrong
    setup.runner      # worker.start.RunnerOptions: what every rank needs (device, dtype, model config)
    setup.scheduler   # engine.scheduler.SchedulerConfig
    setup.api         # http.app.ApiOptions

`resolve` is the only place that reads the checkpoint's config.json, chooses the device and dtype,
and reads the SHIFTLM_* environment; everything downstream takes the resolved values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.parallel import ParallelConfig
from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.scheduler import SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.engine.speculative import SpeculativeConfig
from shiftlm.serve.flag_checks import DTYPES, check_flags
from shiftlm.serve.generation_config import GenerationDefaults, read_generation_config
from shiftlm.serve.http.app import ApiOptions
from shiftlm.serve.worker.start import RunnerOptions

API_KEY_ENV = "SHIFTLM_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    model: str
    tp: int = 1
    sp: int = 1
    mode: str = "shift"  # plan.MODE_NAMES
    shift_threshold: int | str = "auto"  # auto: measured at startup (serve/worker/shift_probe.py)
    num_blocks: int | None = None  # None: 256 on the CPU; on a GPU what --gpu-memory-utilization leaves
    gpu_memory_utilization: float = 0.9  # of each GPU's memory, for weights, activations and KV cache
    block_size: int = 16
    max_num_seqs: int = 64
    max_tokens_per_step: int = 256
    max_pending: int = 512
    enforce_eager: bool = False  # every step eager (default: small decode steps compiled, compiled_step.py)
    cuda_graph_sizes: tuple[int, ...] = ()  # decode batches captured (decode_graphs.capture_sizes)
    async_scheduling: bool = False  # schedule step N+1 while step N runs (engine/core.py)
    scheduling_policy: str = "fcfs"  # fcfs | priority (vLLM's)
    generation_config: str = "auto"  # auto | vllm | a directory (serve/generation_config.py)
    override_generation_config: str | dict | None = None
    speculative_config: str | dict | None = None  # vLLM's JSON, or its dict (engine/speculative.py)
    # structured JSON outputs may put any whitespace between tokens (vLLM's default); else ", " / ": "
    structured_outputs_any_whitespace: bool = False
    enable_auto_tool_choice: bool = False  # tool_choice "auto": calls parsed out of replies
    tool_call_parser: str | None = None  # http/tool_parsers.TOOL_CALL_PARSERS
    reasoning_parser: str | None = None  # http/reasoning.REASONING_PARSERS
    attention_backend: str = "auto"  # worker.ATTENTION_BACKENDS
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
    # connections (serve/http/uvicorn_server.py): None = as many as the open-file limit allows
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

    def torch_dtype(self, device_type: str = "cpu") -> str:
        """The weights' and cache's dtype; `auto` is bfloat16 on a GPU, float32 on the CPU (the
        CPU/gloo engine's parity dtype)."""
        dtype = DTYPES[self.dtype]
        return ("bfloat16" if device_type == "cuda" else "float32") if dtype == "auto" else dtype

    def engine_device(self, under_torchrun: bool):
        """This rank's device (`mesh.choose_device`, as training chooses it): --device checked against
        what is visible; the local ranks `shiftlm serve` starts itself (tp*sp) all sit on this node."""
        from shiftlm.mesh import choose_device

        return choose_device(self.device, None if under_torchrun else self.tp * self.sp)

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

    def resolve(self, environ: dict[str, str] | None = None) -> ServeSetup:
        """Check everything (the checkpoint, the layout against the model, the limits, the tokenizer
        and the chat template) and resolve it into the setup the ranks run: before any process starts,
        so a bad flag is one line and exit 2 (a bad checkpoint: 3)."""
        env = os.environ if environ is None else environ
        self._check_flags()
        config = ModelConfig.from_hf(self.model)
        parallel = ParallelConfig(tp=self.tp, sp=self.sp)
        parallel.check_model(config, shift=True)
        import torch

        from shiftlm.mesh import check_dtype

        under_torchrun = "RANK" in env and "WORLD_SIZE" in env
        device, backend = self.engine_device(under_torchrun)
        dtype = self.torch_dtype(device.type)
        check_dtype(device, getattr(torch, dtype))
        if self.attention_backend == "flex":
            from shiftlm.serve.worker.flex_decode import check_flex

            check_flex(device, self.block_size, config.head_dim)
        num_blocks, activations = self._kv_blocks(config, parallel, device, dtype)
        from shiftlm.serve.engine.tokenizer import load_tokenizer

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
        # tests set SHIFTLM_ENFORCE_EAGER=1 (tests/conftest.py): no compile in every server they start;
        # SHIFTLM_COMPILE_DECODE=1 turns the compiled decode on whatever the flags say (a suite on it)
        eager = self.enforce_eager or env.get("SHIFTLM_ENFORCE_EAGER") == "1"
        runner = RunnerOptions(
            model=self.model,
            model_config=config,
            parallel=parallel,
            device=device.type,
            backend=backend,
            dtype=dtype,
            num_blocks=num_blocks,
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            activation_bytes=activations,
            compile_decode=not eager or env.get("SHIFTLM_COMPILE_DECODE") == "1",
            max_num_seqs=self.max_num_seqs,
            cuda_graph_sizes=tuple(self.cuda_graph_sizes),
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
            shm_collectives=env.get("SHIFTLM_SHM_COLLECTIVES", "1") != "0",
            seed=self.seed,
            cpu_bind=self.cpu_bind,
            spin_wait=self.spin_wait,
        )
        # vLLM's default name: the checkpoint's `_name_or_path` if its config.json has one
        served_name = self.served_model_name or config.name_or_path or self.model
        generation = self.generation_defaults()
        api = ApiOptions(
            model_name=served_name,
            api_key=self.api_key or env.get(API_KEY_ENV) or None,
            max_request_bytes=self.max_request_bytes,
            chat_template=template,
            step_timeout=self.step_timeout,
            body_timeout=self.body_timeout,
            tool_call_parser=self.tool_call_parser if self.enable_auto_tool_choice else None,
            reasoning_parser=self.reasoning_parser,
            sampling_defaults=generation.sampling,
        )
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        eos = [*eos, *generation.eos_token_ids]  # some name their end of turn only there
        setup = ServeSetup(
            flags=self,
            model_config=config,
            parallel=parallel,
            runner=runner,
            scheduler=None,
            api=api,
            tokenizer=tokenizer,
            eos_token_ids=frozenset(e for e in eos if e is not None),
            measure_shift_threshold=self.shift_threshold == "auto" and self.mode == "shift" and self.sp > 1,
            rank=int(env["RANK"]) if under_torchrun else 0,
            under_torchrun=under_torchrun,
        )
        return setup if num_blocks is None else setup.with_kv_blocks(num_blocks)

    def _kv_blocks(
        self, config: ModelConfig, parallel: ParallelConfig, device, dtype: str
    ) -> tuple[int | None, int]:
        """(--num-blocks, or 256 on the CPU, or None: sized by each GPU rank once its weights are
        loaded; a step's activation bound). On a GPU the cache it would get is estimated now, from
        this GPU's free memory, so that a --gpu-memory-utilization that leaves no room for one
        sequence is refused before any rank starts."""
        import torch

        from shiftlm.serve.worker.kv_memory import (
            CPU_BLOCKS,
            activation_bytes,
            blocks_for_memory,
            check_capacity,
            kv_bytes_per_block,
        )

        dtype_bytes = getattr(torch, dtype).itemsize
        activations = activation_bytes(
            config, parallel, self.max_tokens_per_step, self.max_num_seqs, dtype_bytes
        )
        if self.num_blocks is not None or device.type != "cuda":
            return self.num_blocks or CPU_BLOCKS, activations
        free, total = torch.cuda.mem_get_info(device)
        weights = config.num_params * dtype_bytes // parallel.tp  # sp ranks hold the same tp shard
        per_block = kv_bytes_per_block(config, parallel, self.block_size, dtype_bytes)
        estimate = blocks_for_memory(
            free, total, self.gpu_memory_utilization, activations, per_block, weights
        )
        share = f"--gpu-memory-utilization {self.gpu_memory_utilization:g} of {total / 2**30:.1f} GiB"
        check_capacity(
            estimate,
            self.block_size,
            self.max_model_len,
            f"{share}, after ~{weights / 2**30:.1f} GiB of weights",
        )
        return None, activations

    def _check_flags(self) -> None:
        """The flags alone, before the checkpoint is read (serve/flag_checks.py)."""
        check_flags(self)

    def generation_defaults(self) -> GenerationDefaults:
        """The checkpoint's generation_config.json (or --generation-config's) with the override,
        checked as a request's sampling parameters are (ConfigError naming the file)."""
        generation = read_generation_config(
            self.model, self.generation_config, self.override_generation_config
        )
        try:
            SamplingParams(**dict(generation.sampling)).validate()
        except InvalidRequest as err:
            raise ConfigError(f"{generation.source or '--override-generation-config'}: {err}") from None
        return generation

    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config parsed (ConfigError naming the key when it is wrong)."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)


@dataclass(frozen=True)
class ServeSetup:
    """The flags resolved and checked once (`ServeOptions.resolve`): what the server starts from."""

    flags: ServeOptions  # the flags as given (the HTTP server's own: host, port, timeouts, logs)
    model_config: ModelConfig
    parallel: ParallelConfig
    runner: RunnerOptions
    scheduler: SchedulerConfig | None  # None until the KV cache is sized (on a GPU: by the loaded ranks)
    api: ApiOptions
    tokenizer: Any
    eos_token_ids: frozenset[int]
    measure_shift_threshold: bool  # --shift-threshold auto with SP > 1: measured once the ranks run
    rank: int = 0
    under_torchrun: bool = False

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def with_kv_blocks(self, num_blocks: int) -> ServeSetup:
        """The scheduler's options for a cache of `num_blocks` per rank; the context length is
        --max-model-len, or what the model and the cache allow."""
        from shiftlm.serve.worker.kv_memory import check_capacity

        flags, config = self.flags, self.model_config
        if flags.num_blocks is None and self.runner.device == "cuda":  # sized from GPU memory
            share = f"{num_blocks} blocks of {flags.block_size}: --gpu-memory-utilization {flags.gpu_memory_utilization:g}"
            check_capacity(num_blocks, flags.block_size, flags.max_model_len, share)
        fits = min(config.max_position_embeddings, num_blocks * flags.block_size)
        if flags.max_model_len is not None and not 1 < flags.max_model_len <= fits:
            raise ConfigError(
                f"--max-model-len {flags.max_model_len} must be in [2, {fits}] (the model's "
                f"{config.max_position_embeddings} positions and the cache's {num_blocks} x "
                f"{flags.block_size} tokens); raise --num-blocks for more"
            )
        threshold = 64 if flags.shift_threshold == "auto" else flags.shift_threshold
        scheduler = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=flags.block_size,
            max_num_seqs=flags.max_num_seqs,
            max_tokens_per_step=flags.max_tokens_per_step,
            max_model_len=flags.max_model_len if flags.max_model_len is not None else fits,
            policy=ShiftPolicy.named(flags.mode, threshold),
            enable_prefix_caching=flags.enable_prefix_caching,
            speculative=flags.speculative(),
            scheduling_policy=flags.scheduling_policy,
        )
        return dataclasses.replace(self, scheduler=scheduler)

    def describe_kv_cache(self) -> str:
        """The startup line's words for the cache: its tokens per rank and the concurrency they allow."""
        scheduler = self.scheduler
        tokens = scheduler.num_blocks * scheduler.block_size
        return (
            f"KV cache {tokens:,} tokens per rank ({scheduler.num_blocks} blocks of {scheduler.block_size}): "
            f"{tokens / scheduler.max_model_len:.1f}x requests of max_model_len={scheduler.max_model_len} at once"
        )

    def with_shift_threshold(self, threshold: int) -> ServeSetup:
        """The setup after `--shift-threshold auto` was measured (worker/shift_probe.py)."""
        policy = ShiftPolicy.named(self.flags.mode, threshold)
        return dataclasses.replace(self, scheduler=dataclasses.replace(self.scheduler, policy=policy))
