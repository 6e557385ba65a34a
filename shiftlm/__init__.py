"""shiftlm: one LLM across many devices, for training and serving.

from shiftlm import LLM, SamplingParams, StructuredOutputsParams   # the offline batch API (serve/llm.py)
"""

__version__ = "0.1.0"

__all__ = ["__version__", "LLM", "SamplingParams", "StructuredOutputsParams", "errors", "config", "hardware", "presets", "kernels",
           "comm", "mesh", "monitor", "launch", "model", "pipeline", "tools", "serve", "train", "sim",
           "data"]  # fmt: skip


def __getattr__(name: str):
    """`LLM`, `SamplingParams` and `StructuredOutputsParams` on first use: `import shiftlm` stays free
    of torch."""
    if name in ("LLM", "SamplingParams", "StructuredOutputsParams"):
        from shiftlm.serve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'shiftlm' has no attribute {name!r}")
