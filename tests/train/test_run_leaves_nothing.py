"""A finished training run leaves nothing alive in its process: not its gradient buffers, not its
process groups (each gloo group holds threads that wake while idle). A notebook, the test suite's
worker pools and `shiftlm verify` run many in one process."""

from __future__ import annotations

import pytest

RUN = [
    "--model.name=micro",
    "--train.seq_len=32",
    "--train.global_batch=4",
    "--train.steps=2",
    "--log.progress=off",
    "--checkpoint.enable=false",
]


def what_runs_leave(layout: list[str], log_dir: str) -> dict:
    import gc
    import os
    import weakref

    from shiftlm.train.config import load_config
    from shiftlm.train.trainer import Trainer, train

    # the trainer's gradient hooks must not hold it (a cycle through autograd the collector cannot see)
    trainer = Trainer(load_config(None, [*RUN, *layout, f"--log.dir={log_dir}/t"]), quiet=True)
    trainer.run()
    trainer.mesh.close()
    grad_sync, flat = weakref.ref(trainer.grad_sync), weakref.ref(trainer.flat)
    del trainer
    gc.collect()
    threads = []
    for attempt in range(3):  # `train()` closes its process groups
        train(load_config(None, [*RUN, *layout, f"--log.dir={log_dir}/{attempt}"]), quiet=True)
        gc.collect()
        threads.append(len(os.listdir("/proc/self/task")))
    return {"grad_sync": grad_sync() is not None, "flat": flat() is not None, "threads": threads}


@pytest.mark.parametrize(
    "layout", [["--parallel.dp=2"], ["--parallel.dp=2", "--train.zero=2"]], ids=["dp2", "dp2_zero2"]
)
def test_a_finished_run_frees_its_gradients_and_process_groups(ranks, tmp_path, layout):
    for result in ranks.run(2, what_runs_leave, layout, str(tmp_path)):
        assert not result["grad_sync"] and not result["flat"], result
        assert result["threads"][2] == result["threads"][0], result  # no run leaves threads behind
