"""The training configuration: typed sections read from TOML, with `--section.key=value` overrides.

The file format is the one `shiftlm plan train` writes ([model], [parallel], [train]) plus the
sections a run needs beyond the plan ([optim], [data], [checkpoint], [log]). Every section and key
is checked: a typo gets a "did you mean" and a bad value says which values are allowed, so a run
fails in its first second rather than after an hour.

    cfg = load_config("plan.toml", ["--train.steps=200", "--parallel.dp=2"])
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib

from shiftlm.config import LOSS_CHUNK, RECOMPUTE_MODES, ZERO_STAGES
from shiftlm.errors import ConfigError
from shiftlm.parallel import ParallelConfig

DTYPES = ("auto", "fp32", "bf16")
COMPILE_CHOICES = ("auto", "true", "false")


@dataclass
class ModelSection:
    name: str = "tiny"  # a preset name, or a path to an HF config.json / checkpoint dir


@dataclass
class TrainSection:
    micro_batch: int = 1
    global_batch: int = 8  # sequences per optimizer step, over all DP ranks and accumulation steps
    seq_len: int = 128
    schedule: str = "1f1b"
    chunks: int = 1  # pipeline stages per rank (interleaved / V schedules)
    recompute: str = "none"  # activation recomputation: none, selective (attention core), full (layers)
    overlap_grad_sync: bool = True  # start each bucket's DP all-reduce as soon as its gradients are final
    bucket_mb: float = 4.0  # DP all-reduce bucket size in MiB (DDP's bucket_cap_mb)
    zero: int = 1  # 0: replicated; 1: optimizer state, 2: + gradients, 3: + parameters sharded over DP
    steps: int = 100
    seed: int = 0
    dtype: str = "auto"  # auto: bf16 autocast where the device supports it, fp32 on CPU
    device: str = "auto"  # auto: GPU LOCAL_RANK + NCCL where CUDA is visible, else CPU + gloo; cuda; cpu
    # tokens per chunk of the fused LM head + loss (model/loss.py): the whole batch's logits never exist;
    # 0 materialises them (the plain head and cross-entropy)
    loss_chunk: int = LOSS_CHUNK
    compile: str = (
        "auto"  # torch.compile each decoder layer (model/compile.py); auto: on CUDA only; true; false
    )
    # the step's bits independent of ep (docs/moe.md, "Bit-exact across ep"; Megatron's --deterministic-mode):
    # expert GEMMs per source rank, gradients and the clipping norm summed in one fixed tree; ZeRO 0/1
    deterministic: bool = False


@dataclass
class OptimSection:
    lr: float = 3e-3
    min_lr: float = 3e-4  # the cosine decays from lr to min_lr at the last step
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    fused: str = (
        "auto"  # the AdamW update as one compiled kernel (train/optim.py); auto: on CUDA; true; false
    )


@dataclass
class DataSection:
    source: str = "stdlib"  # "stdlib" (embedded corpus) or a file/dir of text, JSONL, parquet, .bin shards
    format: str = "text"  # "streams": source is JSONL {prefix, streams: [...]} samples (train/streams.py)
    text_key: str = "text"  # the field holding the text in JSONL and parquet records
    tokenizer: str = ""  # an HF tokenizer dir; empty: the byte-level BPE trained on the stdlib corpus
    vocab_size: int = 2048  # of the embedded tokenizer
    corpus_mb: float = 4.0  # size of the embedded corpus


@dataclass
class CheckpointSection:
    enable: bool = True  # false: this run writes no checkpoint and resumes from none (torchtitan's name)
    every: int = 0  # save every N steps; 0: only at the end (and as every_s, and on SIGINT/SIGTERM)
    every_s: float = 300.0  # also save when this many seconds passed since the last save; 0: off
    keep: int = 2  # checkpoints kept on disk (oldest deleted first)
    resume: bool = True  # continue from the newest checkpoint in <log.dir>/checkpoints if one exists
    overwrite: bool = False  # with resume = false: delete another run's checkpoints and metrics in log.dir

    @property
    def resumes(self) -> bool:
        """Whether the run continues from log.dir's newest checkpoint (a run without checkpoints never)."""
        return self.enable and self.resume


@dataclass
class LogSection:
    dir: str = "runs/train"  # metrics.jsonl, loss.png and checkpoints/ go here
    progress: str = "auto"  # auto: a progress bar when stderr is a terminal; on; off
    peak_tflops: float = 0.0  # one device's peak for MFU; 0: from its name (hardware catalog), else n/a


@dataclass
class MonitorSection:
    # seconds a collective may stay pending before the watchdog names the rank that never entered it,
    # dumps the ledgers to <log.dir>/ledgers and exits (code 75) so torchrun restarts from the last
    # checkpoint; 0 turns the watchdog off. Keep it below the process group's timeout.
    watchdog_s: float = 300.0
    # every N steps rank 0 gathers the collective ledgers, names a persistently slow rank, and writes
    # them to <log.dir>/ledgers for `shiftlm monitor report`; 0 turns it off
    straggler_every: int = 20


@dataclass
class ValidationSection:
    # as torchtitan's [validation]: every `freq` steps (and at the last step) the loss on `steps` global
    # batches held out from the end of the data (never trained on); 0 turns it off and holds out nothing
    freq: int = 0
    steps: int = 2


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # [parallel]: the one layout type
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    validation: ValidationSection = field(default_factory=ValidationSection)

    @property
    def accumulation(self) -> int:
        """Micro-batches each DP rank runs per optimizer step."""
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" Did you mean '{close[0]}'?" if close else f" Known: {', '.join(choices)}."


def _coerce(value: Any, kind: type, where: str) -> Any:
    """Check a TOML value (or parse an override string) against the field's declared type."""
    if isinstance(value, bool) and kind is str:  # a TOML `compile = true` for a choice of strings
        return str(value).lower()
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        try:
            if kind is bool:
                if text not in ("true", "false", "1", "0"):
                    raise ValueError
                return text in ("true", "1")
            return kind(text)
        except ValueError:
            article = "an" if kind.__name__[0] in "aeiou" else "a"
            raise ConfigError(
                f"{where} = {value!r} is not {article} {kind.__name__}; give e.g. {where}=1"
            ) from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        raise ConfigError(f"{where} = {value!r} must be {article} {kind.__name__}")
    return value


def _apply(config: TrainConfig, section: str, key: str, value: Any) -> None:
    sections = {f.name: f for f in dataclasses.fields(config)}
    if section not in sections:
        raise ConfigError(f"unknown config section [{section}].{_did_you_mean(section, list(sections))}")
    target = getattr(config, section)
    keys = {f.name: f for f in dataclasses.fields(target)}
    if key not in keys:
        raise ConfigError(f"unknown config key '{section}.{key}'.{_did_you_mean(key, list(keys))}")
    kind = {"int": int, "float": float, "str": str, "bool": bool}[str(keys[key].type)]
    # a new section rather than setattr: [parallel] is the frozen ParallelConfig, which checks itself
    setattr(config, section, dataclasses.replace(target, **{key: _coerce(value, kind, f"{section}.{key}")}))


def parse_overrides(overrides: list[str]) -> list[tuple[str, str, str]]:
    """`["--train.steps=5"]` -> `[("train", "steps", "5")]`."""
    parsed = []
    for item in overrides:
        body = item[2:] if item.startswith("--") else item
        dotted, sep, value = body.partition("=")
        section, dot, key = dotted.partition(".")
        if not sep or not dot or not section or not key:
            raise ConfigError(
                f"cannot read override {item!r}; write it as --section.key=value, e.g. --train.steps=50"
            )
        parsed.append((section, key, value))
    return parsed


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file (if any), then the overrides; validated."""
    config = TrainConfig()
    problems: list[str] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass the path of a TOML file")
        try:
            document = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path} is not valid TOML: {err}") from None
        for section, table in document.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: '{section}' must be a [section] table, not a top-level key")
            for key, value in table.items():
                problems += _collect(config, section, key, value)
    for section, key, value in parse_overrides(overrides or []):
        problems += _collect(config, section, key, value)
    if problems:  # every bad key at once, not one per run
        raise ConfigError("; ".join(problems))
    validate(config)
    return config


def _collect(config: TrainConfig, section: str, key: str, value: Any) -> list[str]:
    """`_apply`, with its complaint returned rather than raised (so all of them can be reported)."""
    try:
        _apply(config, section, key, value)
    except ConfigError as err:
        return [str(err)]
    return []


def config_from_dict(raw: dict[str, dict[str, Any]]) -> TrainConfig:
    """The inverse of `TrainConfig.to_dict` (how `--nproc` workers receive their config)."""
    config = TrainConfig()
    for section, table in raw.items():
        for key, value in table.items():
            _apply(config, section, key, value)
    validate(config)
    return config


def validate(config: TrainConfig) -> None:
    """Checks that need no model: positive sizes, known modes, a batch that divides evenly."""
    for section in (config.parallel, config.train, config.checkpoint, config.validation):
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            minimum = 0 if f.name in ("zero", "every", "seed", "freq", "loss_chunk", "etp") else 1
            if f.type == "int" and value < minimum:
                raise ConfigError(f"{f.name} = {value} must be >= {minimum}")
    train, optim = config.train, config.optim
    if train.recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"train.recompute = {train.recompute!r}; use one of {', '.join(RECOMPUTE_MODES)}")
    if config.parallel.pp == 1 and train.schedule != TrainSection.schedule:
        raise ConfigError(
            f"train.schedule = {train.schedule!r} schedules a pipeline, but parallel.pp = 1 (no pipeline): "
            "set --parallel.pp to 2 or more, or drop train.schedule"
        )
    if config.checkpoint.every_s < 0:
        raise ConfigError(f"checkpoint.every_s = {config.checkpoint.every_s} must be >= 0 (0: off)")
    if not config.checkpoint.enable and config.checkpoint.every:
        raise ConfigError(
            f"checkpoint.every = {config.checkpoint.every} asks for checkpoints that checkpoint.enable = false "
            "turns off: drop one"
        )
    if train.bucket_mb <= 0:
        raise ConfigError(f"train.bucket_mb = {train.bucket_mb} must be > 0 (MiB per all-reduce bucket)")
    if train.compile not in COMPILE_CHOICES:
        raise ConfigError(f"train.compile = {train.compile!r}; use one of {', '.join(COMPILE_CHOICES)}")
    if optim.fused not in COMPILE_CHOICES:
        raise ConfigError(f"optim.fused = {optim.fused!r}; use one of {', '.join(COMPILE_CHOICES)}")
    if train.dtype not in DTYPES:
        raise ConfigError(f"train.dtype = {train.dtype!r}; use one of {', '.join(DTYPES)}")
    if train.zero not in ZERO_STAGES:
        raise ConfigError(
            f"train.zero = {train.zero}; shiftlm implements ZeRO stages {', '.join(map(str, ZERO_STAGES))}"
        )
    per_step = train.micro_batch * config.parallel.dp
    if train.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch = {train.global_batch} is not a multiple of micro_batch x dp = {per_step}; "
            f"use e.g. global_batch = {max(1, round(train.global_batch / per_step)) * per_step}"
        )
    if optim.lr <= 0 or not 0 <= optim.min_lr <= optim.lr:
        raise ConfigError(
            f"need 0 <= optim.min_lr <= optim.lr and lr > 0; got lr={optim.lr}, min_lr={optim.min_lr}"
        )
    if not (0 <= optim.beta1 < 1 and 0 <= optim.beta2 < 1):
        raise ConfigError("optim.beta1 and optim.beta2 must lie in [0, 1)")
    if optim.grad_clip < 0 or optim.weight_decay < 0 or optim.warmup_steps < 0:
        raise ConfigError("optim.grad_clip, optim.weight_decay and optim.warmup_steps must be >= 0")
    if config.log.progress not in ("auto", "on", "off"):
        raise ConfigError(f"log.progress = {config.log.progress!r}; use auto, on or off")
