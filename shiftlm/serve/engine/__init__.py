"""The engine core (rank 0): requests in, outputs out; the model is any `plan.Runner`.

`async_engine.AsyncEngine` is the one interface the HTTP front uses; `core.Engine` the synchronous
step; `scheduler` and `kv_blocks` import no torch (the serving simulator drives them too)."""

__all__ = ["async_engine", "core", "errors", "requests", "scheduler", "sequence", "kv_blocks", "sampling",
           "streams", "stream_group", "metrics", "text", "tokenizer"]  # fmt: skip
