"""The device is chosen once (`mesh.choose_device`), and bad device input is one line naming the fix,
before any collective. CUDA is faked with monkeypatch so that these run the same on any machine."""

from __future__ import annotations

import pytest
import torch

from shiftlm.cli import main
from shiftlm.errors import ConfigError
from shiftlm.mesh import check_dtype, choose_device
from shiftlm.serve.options import ServeOptions


def fake_gpus(monkeypatch, count: int, bf16: bool = True) -> list[int]:
    """Pretend `count` GPUs are visible; returns the list that records torch.cuda.set_device calls."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-32GB")
    return chosen


def test_auto_is_the_cpu_with_gloo_when_no_gpu_is_visible(monkeypatch):
    fake_gpus(monkeypatch, 0)
    assert choose_device("auto") == (torch.device("cpu"), "gloo")
    assert choose_device("cpu") == (torch.device("cpu"), "gloo")


def test_auto_is_gpu_local_rank_with_nccl_and_makes_it_current(monkeypatch):
    chosen = fake_gpus(monkeypatch, 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert choose_device("auto") == (torch.device("cuda", 3), "nccl")
    assert chosen == [3]
    assert choose_device("cpu") == (torch.device("cpu"), "gloo")  # asked for: the GPUs stay unused


def test_cuda_without_a_gpu_names_the_fix(monkeypatch):
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="no CUDA GPU is visible.*use device cpu"):
        choose_device("cuda")


def test_more_ranks_on_a_node_than_visible_gpus_names_the_fix(monkeypatch):
    chosen = fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(
        ConfigError, match="4 ranks on this node need 4 GPUs but 2 are visible.*--nproc-per-node 2"
    ):
        choose_device("auto")
    assert chosen == []  # refused before touching a GPU
    # serve's own local ranks (tp*sp of them) count the same way
    with pytest.raises(ConfigError, match="4 ranks on this node need 4 GPUs"):
        ServeOptions(model="unused", tp=2, sp=2).engine_device(under_torchrun=False)


def test_an_unknown_device_is_refused():
    with pytest.raises(ConfigError, match="device 'tpu' is not one of auto, cuda, cpu"):
        choose_device("tpu")


def test_bf16_on_a_gpu_without_it_names_the_fix(monkeypatch):
    fake_gpus(monkeypatch, 1, bf16=False)
    with pytest.raises(ConfigError, match="V100.* has no bf16: use float16 or float32"):
        check_dtype(torch.device("cuda", 0), torch.bfloat16)
    check_dtype(torch.device("cuda", 0), torch.float16)  # the fix is accepted
    check_dtype(torch.device("cpu"), torch.bfloat16)  # the CPU computes bf16


def test_serving_dtype_auto_is_bf16_on_gpus_and_fp32_on_the_cpu():
    options = ServeOptions(model="unused")
    assert options.torch_dtype("cuda") == "bfloat16"
    assert options.torch_dtype("cpu") == "float32"
    assert ServeOptions(model="unused", dtype="half").torch_dtype("cuda") == "float16"


def test_train_device_cuda_without_a_gpu_is_one_line_before_any_rank_starts(monkeypatch, capsys, tmp_path):
    fake_gpus(monkeypatch, 0)
    argv = ["train", "--model.name=micro", "--train.device=cuda", f"--log.dir={tmp_path / 'run'}"]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "no CUDA GPU is visible" in err and "use device cpu" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_mesh_without_a_process_group_or_device_is_on_the_cpu():
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig

    assert Mesh(ParallelConfig()).device == torch.device("cpu")
    assert Mesh(ParallelConfig(), device="meta").device == torch.device("meta")


def test_a_pipeline_runs_on_gpus_its_p2p_follows_nccls_posting_order(monkeypatch):
    """pp > 1 is accepted on GPUs since every pair of ranks posts one order (test_p2p_posting_order)."""
    from shiftlm.train.config import load_config
    from shiftlm.train.preflight import run_device

    fake_gpus(monkeypatch, 8)
    assert run_device(load_config(None, ["--parallel.pp=2"]), 1) == torch.device("cuda", 0)
    assert run_device(load_config(None, ["--parallel.pp=2", "--train.device=cpu"]), 1).type == "cpu"
    assert run_device(load_config(None, ["--parallel.tp=2"]), 1) == torch.device("cuda", 0)
