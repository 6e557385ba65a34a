"""The model's `generation_config.json`, read as vLLM reads it (`--generation-config auto`, its default).

    defaults = read_generation_config(model_dir, "auto", '{"temperature": 0.5}')
    defaults.sampling        # (("temperature", 0.5), ("top_p", 0.9), ...): what a request leaves unset
    defaults.eos_token_ids   # its eos_token_id(s): they end a sample as config.json's EOS does

The sampling keys vLLM takes from it (temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as the default max_tokens) are the defaults of every request that does not send
them: Qwen's or Llama's published settings, not 1.0 and no filter. Its `eos_token_id` joins the
config's: Meta-Llama-3-8B-Instruct as first published names its end of turn (<|eot_id|>, 128009)
only there. `--generation-config vllm` ignores the file, a directory reads that one's, and
`--override-generation-config` JSON sets or overrides keys on top (on top of nothing with vllm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shiftlm.errors import ConfigError

# generation_config.json key -> SamplingParams field (vLLM's list)
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: tuple[tuple[str, float | int], ...] = ()  # SamplingParams field, value
    eos_token_ids: tuple[int, ...] = ()
    source: str | None = None  # the file read (None: none)

    def describe(self) -> str:
        values = ", ".join(f"{name}={value}" for name, value in self.sampling)
        return f"default sampling parameters from {self.source or '--override-generation-config'}: {values}"


def read_generation_config(
    model: str, choice: str = "auto", override: str | dict | None = None
) -> GenerationDefaults:
    """`choice`: auto (the model directory's file), vllm (none), or a directory holding one."""
    source: dict = {}
    path = None
    if choice != "vllm":
        folder = Path(model if choice == "auto" else choice)
        if choice != "auto" and not folder.is_dir():
            raise ConfigError(f"--generation-config {choice!r} is not auto, vllm or a directory")
        path = folder / "generation_config.json"
        if path.is_file():
            source = _json(path.read_text(), str(path), "fix the file or pass --generation-config vllm")
        else:
            path = None
    values = {SAMPLING_KEYS[k]: v for k, v in source.items() if k in SAMPLING_KEYS and v is not None}
    if override is not None:
        extra = (
            override if isinstance(override, dict) else _json(override, "--override-generation-config", "")
        )
        unknown = sorted(set(extra) - set(SAMPLING_KEYS))
        if unknown:
            raise ConfigError(
                f"--override-generation-config: unknown key(s) {', '.join(unknown)}; it takes "
                + ", ".join(SAMPLING_KEYS)
            )
        values.update({SAMPLING_KEYS[k]: v for k, v in extra.items() if v is not None})
    where = str(path) if path is not None else "--override-generation-config"
    for name, value in values.items():
        integral = name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            raise ConfigError(
                f"{where}: {name} must be {'an integer' if integral else 'a number'}, got {value!r}"
            )
    eos = source.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else [e for e in (eos or []) if isinstance(e, int)]
    return GenerationDefaults(tuple(values.items()), tuple(eos), None if path is None else str(path))


def _json(text: str, where: str, fix: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not JSON ({err.msg}){'; ' + fix if fix else ''}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a JSON object")
    return value
