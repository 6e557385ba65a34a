"""A newcomer's first hour (issue 36), through the real `shiftlm` command: progress lines before long
waits, the quickstart's rerun and summary, dp filling --nproc, the simulator's and planner's flags,
the ZB-V Gantt chart, and the small things (every bad key at once, one error prefix, ...).
Ctrl-C / SIGTERM during training: tests/train/test_stop_on_signal.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shiftlm.cli import build_parser, main
from shiftlm.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]
MICRO = ["--model.name=micro", "--train.seq_len=32", "--train.global_batch=2", "--log.progress=off"]


def _shiftlm(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shiftlm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


# -- 1. a line before every long wait, once ----------------------------------------------------------


def test_the_kernel_build_is_announced_once_before_it_starts(tmp_path):
    # an empty extension cache and a compiler that fails at once: the build starts (and is announced)
    # without costing its ~40 s; two pipeline ranks both load the kernels (shared-memory hand-offs)
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "/bin/false"}
    done = _shiftlm(
        "train",
        "--nproc=2",
        "--parallel.pp=2",
        "--train.steps=1",
        *MICRO,
        f"--log.dir={tmp_path / 'run'}",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    building = [i for i, line in enumerate(lines) if "building shiftlm's CPU kernels" in line]
    failed = [i for i, line in enumerate(lines) if "could not be built" in line]
    assert len(building) == 1 and len(failed) == 1, done.stderr  # rank 0 only
    assert building[0] < failed[0]
    assert lines[building[0]].startswith("[shiftlm] ") and "~40 s" in lines[building[0]]
    assert "WARNING" not in lines[building[0]]


def _kernel_load(env: dict, before: str = "pass") -> subprocess.CompletedProcess:
    """`kernels.cpu.load()` in a fresh process after `before` (code with `where`, the build directory,
    and `lock`, torch's lock file in it), printing the module's kind and whether the lock is left."""
    code = (
        "from pathlib import Path; "
        "from torch.utils import cpp_extension; from shiftlm.kernels import cpu as cpu_kernels; "
        "where = Path(cpp_extension._get_build_directory(cpu_kernels._name(), False)); "
        f"lock = where / 'lock'; {before}; module = cpu_kernels.load(); "
        "print(type(module).__name__, lock.exists())"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_a_build_lock_left_by_a_killed_process_is_removed_not_waited_on(tmp_path):
    """A process killed inside torch's loader leaves torch's lock file behind, and every later start
    waited on it forever (seen twice here: whole test runs hung, once over a finished build). Now a
    start removes it, whatever its age: over the suite's finished build (imported, no wait) and over
    no build at all (a compiler that fails at once keeps this quick)."""
    done = _kernel_load(dict(os.environ), "lock.touch()")  # the suite's own build (conftest.py)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["module", "False"], done.stderr  # loaded, not hung, lock gone
    assert "removed a build lock left by a killed process" in done.stderr
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "/bin/false"}
    done = _kernel_load(env, "where.mkdir(parents=True, exist_ok=True); lock.touch()")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["NoneType", "False"]  # not built (no compiler), not hung, lock gone


def test_the_build_lock_of_a_killed_process_is_released():
    """shiftlm's own lock (flock) dies with its holder: a process killed while holding it, in the
    middle of a build as far as anyone can tell, does not keep the next start waiting."""
    from torch.utils import cpp_extension

    from shiftlm.kernels import cpu as cpu_kernels

    where = Path(cpp_extension._get_build_directory(cpu_kernels._name(), False))
    hold = "import fcntl, sys, time; h = open(sys.argv[1], 'a'); fcntl.flock(h, fcntl.LOCK_EX); print(1, flush=True); time.sleep(600)"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(where / "shiftlm.lock")], stdout=subprocess.PIPE
    )
    assert holder.stdout.readline().strip() == b"1"
    (where / "lock").touch()  # and torch's lock, as a build killed inside torch's loader leaves it
    holder.kill()
    holder.wait()
    started = time.monotonic()
    done = _kernel_load(dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["module", "False"], done.stderr
    assert time.monotonic() - started < 60


def test_plan_train_says_what_it_plans_before_it_plans(capsys, tmp_path):
    out = tmp_path / "plan.toml"
    argv = ["plan", "train", "--model", "llama3-8b", "--gpus", "16", "--seq", "4096", "--global-batch", "64"]
    assert main([*argv, "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"planning llama3-8b on 16 x h100-sxm, compiled blocks (best layout -> {out}) ..."
    assert lines[-2].startswith("why 1.: the fastest predicted step that fits (")
    assert lines[-1].startswith(f"wrote {out}: the config of 1.") and out.is_file()
    # with --top 1 the reason still compares the pick with its runner-up (it once said "the only
    # layout that fits" of whichever plan came first, as only one was ranked)
    assert main([*argv, "--out", str(out), "--top", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.startswith("1. ")]) == 1 and not any(
        line.startswith("2. ") for line in lines
    )
    assert lines[-2].startswith("why 1.: the fastest predicted step that fits (")


# -- 3. the quickstart keeps the previous run and ends with what to do next ------------------------


def test_quickstart_announces_itself_ends_with_a_summary_and_keeps_a_finished_run(tmp_path):
    out = tmp_path / "qs"
    done = _shiftlm("quickstart", "--out", str(out), "--steps", "2", timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"quickstart: training into {out} ") and "before step 1" in lines[0]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/2"))
    assert first_step > 0
    summary = lines[lines.index(next(line for line in lines if line.startswith("quickstart done in"))) :]
    text = "\n".join(summary)
    for path in (out / "hf", out / "metrics.jsonl", out / "loss.png", out / "checkpoints" / "step_00000002"):
        assert str(path) in text and path.exists(), text
    assert "2 steps, loss " in summary[0]
    assert f"shiftlm serve --model {out / 'hf'}" in text and "curl localhost:8000/v1/completions" in text
    # the rerun refuses to delete it (exit 6, one line naming --overwrite) and leaves it as it was
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    again = _shiftlm("quickstart", "--out", str(out), "--steps", "2")
    assert again.returncode == 6
    (line,) = again.stderr.strip().splitlines()
    assert line.startswith("shiftlm quickstart: error: ") and "--overwrite" in line and "finished" in line
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_the_quickstart_output_in_the_repository_root_is_ignored_by_git():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in ("quickstart/hf/config.json", "quickstart/metrics.jsonl", "runs/quickstart/loss.png"):
        assert subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", path]).returncode == 0, path


# -- 6. --nproc without a layout: the other ranks are data parallel -------------------------------


def test_nproc_without_a_layout_makes_the_ranks_data_parallel(capsys, tmp_path):
    argv = ["train", "--nproc", "2", "--json", "--train.steps=1", *MICRO, f"--log.dir={tmp_path / 'run'}"]
    assert main(argv) == 0, capsys.readouterr().err
    trained = json.loads((tmp_path / "run" / "checkpoints" / "step_00000001" / "trainer.json").read_text())
    assert trained["layout"]["dp"] == 2
    # an explicit dp that does not match is still refused
    assert main(["train", "--nproc", "2", "--parallel.dp=1", *MICRO, f"--log.dir={tmp_path / 'x'}"]) == 2
    assert "--nproc 1" in capsys.readouterr().err


def test_the_dp_line_is_printed(capsys, tmp_path):
    from shiftlm.train.config import load_config
    from shiftlm.train.preflight import fill_dp

    config, line = fill_dp(load_config(None, ["--parallel.tp=2"]), 8, dp_given=False)
    assert config.parallel.dp == 4
    assert (
        line == "8 ranks, pp*cp*sp*tp = 2: the other ranks are data parallel, dp = 4 (--parallel.dp sets it)"
    )
    assert fill_dp(load_config(None, ["--parallel.tp=2"]), 8, dp_given=True)[1] == ""


# -- 9. simulate / plan flags ---------------------------------------------------------------------


def _children(parser) -> dict:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _sub(command: str):
    """The parser of e.g. "plan train" (nested subcommands)."""
    parser = build_parser(command.split()[0])
    for name in command.split():
        parser = _children(parser)[name]
    return parser


@pytest.mark.parametrize(
    "command",
    ["simulate train", "simulate serve", "simulate validate", "plan train", "plan serve", "calibrate"],
)
def test_every_simulate_and_plan_flag_has_help(command):
    actions = [a for a in _sub(command)._actions if a.option_strings and a.dest != "help"]
    assert len(actions) > 5
    missing = [a.option_strings[0] for a in actions if not a.help]
    assert not missing, missing


def test_presets_are_listed_in_help_and_their_names_normalised(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in PRESETS)
    base = ["simulate", "train", "--gpus", "8", "--tp", "8", "--json", "--model"]
    steps = set()
    for name in ("llama-3-70b", "llama3-70b", "Llama3_70B", "llama-3.3-70b"):
        assert main([*base, name]) == 0, capsys.readouterr().err
        steps.add(json.loads(capsys.readouterr().out)["step_time_s"])
    assert len(steps) == 1  # one shape under every spelling


SERVE = ["--model", "llama-3.3-70b", "--gpu", "h100", "--gpus", "8", "--trace", "azure_code"]


def test_simulate_serve_and_train_default_to_bf16_and_the_goodput_line_prints_its_slo(capsys):
    assert main(["simulate", "serve", *SERVE, "--mode", "shift", "--tp", "4", "--max-requests", "20"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.3-70b (bf16) on 8 x " in out
    assert "% within TTFT 2000 ms and TPOT 100 ms)" in out
    assert " tokens/s prompt + output (" in out and " output tokens/s)" in out
    for command in ("simulate train", "simulate serve", "plan train", "plan serve"):
        assert _sub(command).get_default("dtype") == "bf16", command
    assert (
        main(
            ["simulate", "serve", *SERVE, "--mode", "shift", "--tp", "4", "--max-requests", "20"]
            + ["--slo-ttft-ms", "500"]
        )
        == 0
    )
    assert "within TTFT 500 ms" in capsys.readouterr().out


def test_bench_serve_takes_the_slo_in_ms_and_keeps_the_seconds_spelling():
    parser = build_parser("bench")

    def slo(*flags: str) -> tuple[float, float]:
        args = parser.parse_args(["bench", "serve", "--trace", "azure_code", *flags])
        return args.slo_ttft, args.slo_tpot

    assert slo() == (2.0, 0.2)
    assert slo("--slo-ttft-ms", "500", "--slo-tpot-ms", "50") == (0.5, 0.05)
    assert slo("--slo-ttft", "0.5", "--slo-tpot", "0.05") == (0.5, 0.05)


# -- 10. the ZB-V Gantt chart ---------------------------------------------------------------------


def test_zbv_gantt_legend_clears_the_bars_and_a_ranks_two_chunks_differ(tmp_path, capsys):
    from shiftlm.pipeline.plot import TIME_UNIT, plot_gantt
    from shiftlm.pipeline.schedules import build_schedule
    from shiftlm.pipeline.simulator import ActionCosts, simulate

    png = tmp_path / "zbv.png"
    assert main(["schedule", "--name", "zb_v", "--pp", "4", "--microbatches", "8", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    schedule = build_schedule("zb_v", 4, 8, None)
    layout = plot_gantt(simulate(schedule, ActionCosts(0.5, 0.5, 0.5)), "zb_v", tmp_path / "again.png")
    bx0, by0, bx1, by1 = layout.bars_px
    lx0, ly0, lx1, ly1 = layout.legend_px
    overlap_x = min(bx1, lx1) - max(bx0, lx0)
    overlap_y = min(by1, ly1) - max(by0, ly0)
    assert overlap_x <= 0 or overlap_y <= 0, (layout.bars_px, layout.legend_px)
    for rank in range(4):
        assert layout.colours[(rank, 0)].isdisjoint(layout.colours[(rank, 1)]), rank
    assert "units of --costs" in TIME_UNIT


# -- 11. small things -----------------------------------------------------------------------------


def test_a_config_with_several_bad_keys_names_them_all(capsys, tmp_path):
    argv = ["train", "--train.steps=many", "--optim.lr=fast", *MICRO, f"--log.dir={tmp_path}"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "train.steps = 'many' is not an int" in line and "optim.lr = 'fast' is not a float" in line
    toml = tmp_path / "bad.toml"
    toml.write_text('[train]\nstpes = 3\nseq_len = "long"\n')
    assert main(["train", str(toml)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "'train.stpes'" in line and "train.seq_len = 'long' is not an int" in line


def test_a_pipeline_schedule_without_a_pipeline_is_refused(capsys, tmp_path):
    assert main(["train", "--train.schedule=zb_v", *MICRO, f"--log.dir={tmp_path}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "train.schedule = 'zb_v'" in line and "parallel.pp = 1" in line and "--parallel.pp" in line


def test_export_names_the_step_it_exported(capsys, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--train.steps=2", "--json", *MICRO, f"--log.dir={run}"]) == 0
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--to-hf", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"exported step 2 ({run / 'checkpoints' / 'step_00000002'}) to {tmp_path / 'hf'}"


def test_parameter_counts_read_as_people_write_them():
    from shiftlm.train.dryrun import params_text

    assert [params_text(n) for n in (7.0e6, 1.1e9, 70.6e9, 405e9, 950)] == [
        "7.0M",
        "1.1B",
        "70.6B",
        "405B",
        "950",
    ]


def test_monitor_report_header_names_its_columns(tmp_path, capsys):
    from tests.monitor.test_cli_and_faults import _dump_two_ranks

    _dump_two_ranks(tmp_path, slow_rank=1)
    assert main(["monitor", "report", str(tmp_path)]) == 0
    header = capsys.readouterr().out.splitlines()[1].split()
    assert header[:3] == ["rank", "collectives", "entered"] and "last last" not in " ".join(header)


def test_verify_flags_have_help(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--batch BATCH sequences in the random input batch" in text
    assert "--seq-len SEQ_LEN tokens per sequence" in text


@pytest.mark.parametrize(
    ("argv", "prefix"),
    [
        (["serve"], "shiftlm serve: error: "),
        (["simulate", "train", "--model", "nope", "--gpus", "8"], "shiftlm simulate: error: "),
        (
            ["plan", "train", "--model", "nope", "--gpus", "8", "--seq", "8", "--global-batch", "8"],
            "shiftlm plan: error: ",
        ),
        (["schedule", "--name", "1f1b", "--pp", "4", "--microbatches", "2"], "shiftlm schedule: error: "),
        (["train", "--train.stpes=1"], "shiftlm train: error: "),
        (["verify", "--tp", "x"], "shiftlm verify: error: "),
    ],
)
def test_every_command_errors_with_one_prefix(capsys, tmp_path, argv, prefix):
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(prefix), line


def test_quickstart_into_a_path_it_cannot_write_is_one_line(tmp_path, capsys):
    """The rank launcher's traceback (RankFailure ... FileNotFoundError) when --out could not be made;
    now one line before any rank starts, exit 2."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["quickstart", "--out", str(blocker / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {blocker / 'run'} cannot be written (Not a directory)" in err, err


def test_an_eager_process_never_imports_the_compiler():
    """torch._dynamo costs 1.2 s of import in every rank, server and CLI process; only compiling needs
    it (a `@torch.compiler.disable` decorator at import time pulled it in)."""
    modules = (
        "shiftlm.cli, shiftlm.train.trainer, shiftlm.train.elastic, shiftlm.serve.server, shiftlm.sim.cli"
    )
    code = f"import sys, {modules}; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_reader_that_leaves_the_pipe_gets_no_traceback():
    """`shiftlm simulate train ... | head`: the reader closes the pipe, the command stops quietly with
    what a shell reports for such a tool (141), as Unix tools do."""
    command = [sys.executable, "-m", "shiftlm", "simulate", "train", "--model", "llama3-8b", "--gpu", "h100"]
    proc = subprocess.Popen([*command, "--gpus", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command prints: its write finds no reader
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and stderr == ""


def test_a_broken_pipe_that_is_not_stdout_still_shows(monkeypatch):
    from shiftlm.sim import cli as sim_cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")  # a worker's or a socket's: a bug to see, not hide

    monkeypatch.setattr(sim_cli, "_simulate_train", broken)
    with pytest.raises(BrokenPipeError):
        main(["simulate", "train", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "8"])
