"""Serving, in three rooms and the plan where two of them meet (docs/architecture.md, "Serving"):

- `http/`: the OpenAI-compatible front (FastAPI app, protocol, SSE, auth, access log); the only
  room that knows HTTP. It talks to the engine through `engine.async_engine.AsyncEngine` alone.
- `engine/`: the engine core on rank 0: scheduler (continuous batching, chunked prefill, prefix
  caching, the shift policy) over the KV block manager, requests, sampling, streams, metrics.
- `worker/`: what every rank runs: the model runner, the shift model and its attention backends,
  the plan codec, the rank loop and its heartbeats.
- `plan`: the step plan (`Mode`, `ScheduledChunk`, `StepPlan`) and the `Runner` interface.

`options` resolves the flags once into a `ServeSetup`; `server` starts the ranks and joins the rooms;
`llm` is the offline batch API (`shiftlm.LLM`) over the same engine;
`cli` is `shiftlm serve`; `trace`, `replay` and `local_server` are the load generator's."""

__all__ = ["http", "engine", "worker", "plan", "options", "server", "llm", "trace", "replay", "local_server"]
