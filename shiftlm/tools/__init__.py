"""Tools that check the engine against its references: `verify` (the `shiftlm verify` command: every
layout against `transformers`), `parity` (the comparisons it and the tests run) and `tiny` (tiny real
checkpoints written by `transformers` itself, for tests, examples and benches)."""

__all__ = ["verify", "parity", "tiny"]
