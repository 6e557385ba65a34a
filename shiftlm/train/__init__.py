"""Training: the typed TOML `config` ([parallel] is the core's `ParallelConfig`), the `trainer` loop on
any layout, its `launch` and supervision (`elastic`), data (`sources`, `data`, `tokenizer`),
layout-free `checkpoint`s, the pre-launch checks (`preflight`, `dryrun`), `export` and `quickstart`.

The public modules (`shiftlm train|quickstart|export` are `cli`)."""

__all__ = ["config", "trainer", "elastic", "setup", "preflight", "dryrun", "checkpoint", "data", "sources",
           "streams", "tokenizer", "metrics", "export", "quickstart"]  # fmt: skip
