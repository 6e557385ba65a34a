"""Serving: the torch-free `scheduler` (continuous batching, chunked prefill, prefix caching, the
shift policy) over `kv_blocks`; the `engine` step and its thread-safe `async_engine` front (the
one interface the HTTP `api` uses); `server` starts the ranks; `options` are vLLM's flags.

The public modules; the others are the engine's and the API's internals (`shiftlm serve` is `cli`)."""

__all__ = ["engine", "async_engine", "api", "server", "options", "scheduler", "sequence", "kv_blocks",
           "runner", "sampling", "streams", "metrics", "tokenizer", "trace", "replay", "local_server"]  # fmt: skip
