"""Pipeline parallelism as data: schedules are per-rank action lists (`actions`), built by generators
(`schedules`, `greedy`), lowered to send/recv once (`lowering`), checked (`validate`), timed
(`simulator`) and run (`executor`) by one implementation each; `tied` syncs tied embeddings.

The public modules (the `shiftlm schedule` command is `cli`, reached through `shiftlm.cli`)."""

__all__ = ["actions", "schedules", "greedy", "lowering", "validate", "simulator", "executor", "tied",
           "plot", "peak"]  # fmt: skip
