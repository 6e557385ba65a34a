"""Supervised training: name the failed rank, stop the rest, restart (or shrink) from the checkpoint.

`launch` runs a training job from this process: here (one rank, or this rank of a torchrun job) or on
N local workers. `shiftlm train --nproc N` runs the ranks under `shiftlm.launch.run_ranks`; under torchrun each rank
runs `run_rank`. Either way a failure prints the failed rank's coordinates and its own traceback,
the exit code says whether a restart can help (`shiftlm.monitor.failure`), and the last line says
how to resume.

`--max-restarts K` relaunches the same layout after a restartable failure (what torchrun's agent
does). `--elastic` goes further, as C4 isolates a faulty node (Dong et al. 2024, sec. 3.2): when a
rank is named dead, hung or persistently slow, the job is relaunched *without it*: the data-parallel
replicas that hold the named ranks are dropped (dp shrinks; every replica holds the whole model, so
nothing is lost), the global batch is kept by raising gradient accumulation, and the run resumes
from its newest checkpoint, which is layout-free and holds the data position (samples consumed).
The local launcher's processes stand in for hosts: `SHIFTLM_SLOTS` tells each new rank which launch
slot (its rank in the first attempt) it occupies, so a fault injected on a slot stays excluded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from shiftlm.errors import ConfigError
from shiftlm.monitor import failure
from shiftlm.train.config import TrainConfig


def _describe(config: TrainConfig):
    return lambda rank: failure.describe_coords(config.parallel, rank)


def run_training(config_dict: dict, quiet: bool = False) -> dict:
    """One rank's training run (also the entry point of `--nproc` workers); returns a summary.

    A user error comes back as {"user_error": ...} rather than a traceback, so that the launching
    process reports it as one line with its exit code."""
    from shiftlm.train.config import config_from_dict
    from shiftlm.train.trainer import train

    try:
        result = train(config_from_dict(config_dict), quiet=quiet)
    except ConfigError as err:
        return {"user_error": {"message": str(err), "exit_code": err.exit_code, "type": type(err).__name__}}
    return result.summary()


def launch(config: TrainConfig, nproc: int, quiet: bool, elastic: bool = False, restarts: int = 0) -> dict:
    """Run on this process (torchrun, or one rank) or on `nproc` supervised local gloo workers."""
    import torch.distributed as dist

    if nproc > 1 or elastic or restarts:
        return launch_local(config, nproc, quiet, elastic, restarts)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():  # under torchrun
        from shiftlm.mesh import choose_device

        _, backend = choose_device(config.train.device)  # NCCL on GPU LOCAL_RANK (made current), else gloo
        dist.init_process_group(backend)
        summary = run_rank(config, quiet)  # a failure: printed with its rank, RankFailure
    else:
        summary = run_training(config.to_dict(), quiet)
    _raise_user_error(summary)
    return summary if not dist.is_initialized() or dist.get_rank() == 0 else {}


def _raise_user_error(summary: dict) -> dict:
    """A rank's summary, or the user error it came back with, raised."""
    if "user_error" in summary:
        raise ConfigError(summary["user_error"]["message"], summary["user_error"]["exit_code"])
    return summary


def train_rank(config_dict: dict, quiet: bool) -> dict:
    """A `--nproc` rank: `run_training`, with a user error raised (so the launcher reports it as
    bad input with its exit code, whichever rank met it, and stops the others)."""
    return _raise_user_error(run_training(config_dict, quiet))


def resume_hint(config: TrainConfig, fix_first: bool = False) -> str:
    """One line: how to go on from here (the newest checkpoint, or that there is none)."""
    from shiftlm.train.checkpoint import latest_checkpoint, read_trainer_state

    if not config.checkpoint.enable:
        return "checkpoint.enable is false: a rerun starts from step 0 (with --overwrite)"
    latest = latest_checkpoint(Path(config.log.dir) / "checkpoints")
    if latest is None:
        return "no checkpoint yet: rerunning starts from step 0 (set --checkpoint.every=N to bound the loss)"
    step = read_trainer_state(latest)["step"]
    return (
        f"to resume{' (after fixing the error above)' if fix_first else ''}: rerun the same command (with --checkpoint.resume=true, the default); it continues "
        f"from {latest} (step {step}); add --max-restarts N or --elastic to let shiftlm do it"
    )


def run_rank(config: TrainConfig, quiet: bool) -> dict:
    """This process's rank of a torchrun job: a failure is printed with its rank and coordinates,
    written to torchrun's error file, and raised as `RankFailure` (the CLI returns its exit code)."""
    from shiftlm.launch import RankFailure

    try:
        return run_training(config.to_dict(), quiet)
    except ConfigError:
        raise
    except Exception as err:
        rank = int(os.environ.get("RANK", "0"))
        report = failure.report_exception(rank, err)
        failure.report(report)
        raise RankFailure(report, [], 0.0, _describe(config)) from err


def shrink(config: TrainConfig, culprits: list[int]) -> TrainConfig | None:
    """`config` without the dp replicas holding `culprits`, global batch kept; None if impossible."""
    from shiftlm.mesh import coords_of

    parallel, train = config.parallel, config.train
    lost = {coords_of(parallel, rank).dp for rank in culprits}
    dp = parallel.dp - len(lost)
    while dp >= 1 and train.global_batch % (train.micro_batch * dp):
        dp -= 1  # the global batch must split evenly over the replicas that are left
    if dp < 1:
        return None
    return dataclasses.replace(config, parallel=dataclasses.replace(parallel, dp=dp))


def _kept_slots(config: TrainConfig, culprits: list[int], new_dp: int, slots: list[int]) -> list[int]:
    """Launch slots of the new ranks: the surviving replicas' ranks, in order, first `new_dp` of them."""
    from shiftlm.mesh import coords_of

    inner = config.parallel.pp * config.parallel.sp * config.parallel.tp
    lost = {coords_of(config.parallel, rank).dp for rank in culprits}
    kept = [d for d in range(config.parallel.dp) if d not in lost][:new_dp]
    return [slots[d * inner + i] for d in kept for i in range(inner)]


def _log_event(config: TrainConfig, event: dict) -> None:
    path = Path(config.log.dir) / "restarts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps({"time": time.time(), **event}) + "\n")


def launch_local(
    config: TrainConfig, nproc: int, quiet: bool, elastic: bool = False, max_restarts: int = 0
) -> dict:
    """Train on `nproc` local gloo processes; restart or shrink on failure as asked; rank 0's summary."""
    from shiftlm.launch import RankFailure, run_ranks

    slots = list(range(nproc))
    attempt = 0
    if elastic:
        max_restarts = max(max_restarts, 3)
    while True:
        env = {
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "SHIFTLM_SLOTS": ",".join(map(str, slots)),
            "SHIFTLM_ELASTIC": "1" if elastic else "0",
        }
        try:
            return run_ranks(
                train_rank,
                len(slots),
                config.to_dict(),
                quiet,
                env=env,
                describe=_describe(config),
                usage=ConfigError,
            )
        except RankFailure as err:
            restartable = err.exit_code in (failure.EXIT_TEMPFAIL, failure.EXIT_EXCLUDED)
            if not restartable or attempt >= max_restarts:
                raise
            print(err.text(), file=sys.stderr, flush=True)
            culprits = err.report.culprits if err.report.kind != "peer" else []
            event = {"attempt": attempt, "kind": err.report.kind, "failed": err.report.rank}
            smaller = shrink(config, culprits) if elastic and culprits else None
            if smaller is not None and smaller.parallel.dp < config.parallel.dp:
                slots = _kept_slots(config, culprits, smaller.parallel.dp, slots)
                names = ", ".join(f"rank {r} ({_describe(config)(r)})" for r in culprits)
                print(
                    f"[shiftlm.elastic] excluded {names}: {err.report.message}; relaunching on "
                    f"{len(slots)} rank(s): dp {config.parallel.dp} -> {smaller.parallel.dp}, gradient "
                    f"accumulation {config.accumulation} -> {smaller.accumulation} (global batch "
                    f"{config.train.global_batch} kept), from the newest checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
                event.update(excluded=culprits, dp=smaller.parallel.dp, world=len(slots))
                config = smaller
            else:
                print(
                    f"[shiftlm] restart {attempt + 1}/{max_restarts} on the same {len(slots)} rank(s)",
                    file=sys.stderr,
                    flush=True,
                )
                event.update(world=len(slots))
            _log_event(config, event)
            config = dataclasses.replace(
                config, checkpoint=dataclasses.replace(config.checkpoint, resume=True, overwrite=False)
            )
            attempt += 1
