"""shiftlm: one LLM across many devices, for training and serving."""

__version__ = "0.1.0"

__all__ = ["__version__", "config", "hardware", "presets", "comm", "mesh", "monitor", "launch", "model",
           "pipeline", "serve", "train", "sim", "data"]  # fmt: skip
