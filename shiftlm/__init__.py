"""shiftlm: one LLM across many devices, for training and serving."""

__version__ = "0.1.0"
