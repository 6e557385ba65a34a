"""HF checkpoints in and out of any layout; seeded init independent of the layout; clear errors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.mesh import Mesh
from shiftlm.model import build_model
from shiftlm.model.weights import CheckpointError, gather_full, save_hf_checkpoint
from shiftlm.parallel import ParallelConfig


def _load_and_save(checkpoint, out_dir, tp, sp, pp=1):
    config = ModelConfig.from_hf(checkpoint)
    mesh = Mesh(ParallelConfig(tp=tp, sp=sp, pp=pp))
    model = build_model(config, mesh, checkpoint=checkpoint)
    save_hf_checkpoint(model, out_dir)
    return True


def _all_tensors(directory):
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("tp,sp,pp", [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 1, 2), (1, 2, 2)])
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
def test_hf_round_trip_is_bit_exact(ranks, tiny_checkpoints, tmp_path, family, tp, sp, pp):
    source = tiny_checkpoints[family]
    out = tmp_path / "saved"
    ranks.run(tp * sp * pp, _load_and_save, source, str(out), tp, sp, pp)
    original = load_file(f"{source}/model.safetensors")
    saved = _all_tensors(out)
    assert saved.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name
    if pp > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(original)
        # and the sharded checkpoint loads back, each rank reading only its slices
        ranks.run(tp * sp * pp, _load_and_save, str(out), str(tmp_path / "again"), tp, sp, pp)
        assert all(torch.equal(t, original[n]) for n, t in _all_tensors(tmp_path / "again").items())
    assert not list(tmp_path.glob(".*tmp")), "staging directory left behind"


def test_transformers_loads_what_we_save(tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint = tiny_checkpoints["llama-gqa"]
    model = build_model(ModelConfig.from_hf(checkpoint), checkpoint=checkpoint)
    save_hf_checkpoint(model, tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    ids = torch.randint(0, 250, (1, 12))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, model(ids)[..., :250], rtol=1e-5, atol=1e-6)


def _init_full(tp, sp):
    config = ModelConfig(
        vocab_size=250,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
    )
    model = build_model(config, Mesh(ParallelConfig(tp=tp, sp=sp)), seed=7)
    return gather_full(model)


def test_seeded_init_is_the_same_in_every_layout(ranks):
    single = ranks.run(1, _init_full, 1, 1)[0]
    for tp, sp in [(2, 1), (4, 1), (2, 2)]:
        full = ranks.run(tp * sp, _init_full, tp, sp)[0]
        for name, tensor in single.items():
            assert torch.equal(full[name], tensor), f"{name} differs at tp={tp} sp={sp}"


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["llama"]
    (tmp_path / "config.json").write_text(open(f"{source}/config.json").read())
    tensors = load_file(f"{source}/model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        build_model(ModelConfig.from_hf(tmp_path), checkpoint=tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["llama"]
    raw = json.loads(open(f"{source}/config.json").read())
    raw["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with safe_open(f"{source}/model.safetensors", "pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys()}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight.*shape \[96, 64\].*\[128, 64\]"):
        build_model(ModelConfig.from_hf(tmp_path), checkpoint=tmp_path)


def test_unknown_model_type_says_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="unknown model_type 'gpt2'.*llama, qwen2, mistral"):
        ModelConfig.from_hf(tmp_path)


def test_wrong_world_size_says_how_many_ranks():
    with pytest.raises(ConfigError, match="needs 4 ranks but the world has 2.*nproc-per-node 4"):
        Mesh(ParallelConfig(tp=2, sp=2), rank=0, world_size=2)


def test_heads_not_divisible_by_layout_is_rejected():
    config = ModelConfig(num_heads=8, num_kv_heads=2, hidden_size=64, head_dim=8, intermediate_size=96)
    with pytest.raises(ConfigError, match="sp\\*tp = 3 must divide num_attention_heads = 8"):
        ParallelConfig(tp=3).check_model(config)
    with pytest.raises(ConfigError, match="sequence length 10 must split evenly into sp = 4"):
        ParallelConfig(sp=4).check_sequence(10)
