"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) equal transformers in every layout,
expert parallelism included, and go back to Hugging Face format unchanged."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from shiftlm.comm import counters
from shiftlm.config import ModelConfig
from shiftlm.errors import ConfigError
from shiftlm.parallel import ParallelConfig
from shiftlm.tools.parity import layout_outputs, relative_error
from shiftlm.tools.tiny import MOE_FAMILIES

TOLERANCE = 1e-5

# (tp, sp, megatron sequence parallel, ep); ep ranks are data-parallel ranks with a slice of the batch
LAYOUTS = [
    (2, 1, True, 1),
    (1, 2, False, 1),
    (1, 1, False, 2),
    (2, 1, False, 2),
    (1, 2, False, 2),
]
BATCH = 4


def _assert_close(name, ours, reference):
    abs_err, rel_err = relative_error(ours, reference)
    assert rel_err <= TOLERANCE, f"{name}: max abs {abs_err:.3g}, relative {rel_err:.3g} > {TOLERANCE}"


_single = {}


def _one_rank(ranks, checkpoint):
    if checkpoint not in _single:
        _single[checkpoint] = ranks.run(1, layout_outputs, checkpoint, batch=BATCH, param_grads=True)[0]
    return _single[checkpoint]


def _merged_grads(outputs):
    """Every rank's parameter gradients (an ep rank holds only its experts')."""
    merged = {}
    for out in outputs:
        for name, grad in out.param_grads.items():
            if name in merged:
                assert torch.equal(merged[name], grad), f"{name}: ranks disagree"
            merged[name] = grad
    return merged


@pytest.fixture(scope="module")
def moe_reference(tiny_checkpoints):
    from shiftlm.tools.parity import reference_outputs

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = reference_outputs(tiny_checkpoints[family], batch=BATCH, param_grads=True)
        return cache[family]

    return get


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("tp,sp,sequence_parallel,ep", LAYOUTS, ids=lambda v: str(v))
def test_moe_layout_matches_hf_and_one_rank(
    ranks, tiny_checkpoints, moe_reference, family, tp, sp, sequence_parallel, ep
):
    checkpoint = tiny_checkpoints[family]
    outputs = ranks.run(
        tp * sp * ep,
        layout_outputs,
        checkpoint,
        tp=tp,
        sp=sp,
        ep=ep,
        sequence_parallel=sequence_parallel,
        batch=BATCH,
        param_grads=True,
    )
    ours, reference, single = outputs[0], moe_reference(family), _one_rank(ranks, checkpoint)
    _assert_close("one rank's logits vs HF", single.logits, reference.logits)
    _assert_close("one rank's input-embedding grad vs HF", single.embedding_grad, reference.embedding_grad)
    _assert_close("logits vs HF", ours.logits, reference.logits)
    _assert_close("input-embedding grad vs HF", ours.embedding_grad, reference.embedding_grad)
    grads = _merged_grads(outputs)
    assert grads.keys() == single.param_grads.keys()
    for name, grad in grads.items():
        _assert_close(f"{name} grad vs one rank", grad, single.param_grads[name])
    for other in outputs[1:]:
        assert (other.logits == ours.logits).all()


def test_mixtral_at_ep4_and_its_tie(ranks, tiny_checkpoints, moe_reference):
    """ep = 4 (two experts per rank); the tiny mixtral's layer 0 has two experts with the same router
    row, so every token ties between them and `torch.topk` must break the tie as transformers does."""
    checkpoint = tiny_checkpoints["mixtral"]
    gate = load_file(f"{checkpoint}/model.safetensors")["model.layers.0.block_sparse_moe.gate.weight"]
    assert torch.equal(gate[2], gate[5])
    outputs = ranks.run(4, layout_outputs, checkpoint, ep=4, batch=BATCH, param_grads=True)
    reference = moe_reference("mixtral")
    _assert_close("logits vs HF", outputs[0].logits, reference.logits)
    _assert_close("input-embedding grad vs HF", outputs[0].embedding_grad, reference.embedding_grad)
    experts = {
        name.split(".experts.")[1].split(".")[0] for name in _merged_grads(outputs) if ".experts." in name
    }
    assert experts == {str(e) for e in range(8)}
    assert all(len([n for n in out.param_grads if ".experts." in n]) == 2 * 2 * 3 for out in outputs)


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_all_gather_dispatch_equals_transformers(ranks, tiny_checkpoints, moe_reference, family):
    """bench/moe.py's alternative: every ep rank gathers all tokens and computes its experts' rows."""
    outputs = ranks.run(
        2,
        layout_outputs,
        tiny_checkpoints[family],
        ep=2,
        batch=BATCH,
        dispatch="all_gather",
        param_grads=True,
    )
    reference, single = moe_reference(family), _one_rank(ranks, tiny_checkpoints[family])
    _assert_close("logits vs HF", outputs[0].logits, reference.logits)
    _assert_close("input-embedding grad vs HF", outputs[0].embedding_grad, reference.embedding_grad)
    for name, grad in _merged_grads(outputs).items():
        _assert_close(f"{name} grad vs one rank", grad, single.param_grads[name])


def _ep_traffic(checkpoint):
    counters.reset()
    layout_outputs(checkpoint, ep=2, batch=BATCH)
    return {key: value for key, value in counters.snapshot().items() if key.endswith("/ep")}


def test_ep_dispatches_by_all_to_all(ranks, tiny_checkpoints):
    """ep = 2 moves tokens over the ep group by all-to-all (per MoE layer: the row counts, dispatch and
    combine forward, and the two backward), and by nothing else."""
    per_rank = ranks.run(2, _ep_traffic, tiny_checkpoints["qwen3-moe"])
    for moved in per_rank:
        assert set(moved) == {"all_to_all/ep"}
        assert moved["all_to_all/ep"]["calls"] == 2 * 5  # two MoE layers
        assert moved["all_to_all/ep"]["bytes"] > 0


def test_load_balancing_loss_equals_transformers_and_counts(tiny_checkpoints, tmp_path):
    """The qwen3-moe tiny asks for the aux loss (coefficient 0.1): its value equals transformers'
    `aux_loss`, and it changes the input gradient (so the parity tests above check it)."""
    from transformers import AutoModelForCausalLM

    from shiftlm.mesh import Mesh
    from shiftlm.model import build_model
    from shiftlm.tools.parity import fixed_batch

    checkpoint = tiny_checkpoints["qwen3-moe"]
    config = ModelConfig.from_hf(checkpoint)
    assert config.output_router_logits and config.router_aux_loss_coef == 0.1
    ids, _ = fixed_batch(config.vocab_size, BATCH)
    model = build_model(config, Mesh(ParallelConfig()), checkpoint=checkpoint)
    model(ids)
    term, value = model.router_aux_loss()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    expected = hf(ids, output_router_logits=True).aux_loss
    assert abs(value.item() - expected.item()) <= 1e-6 * expected.item()
    assert torch.equal(term, value)  # one rank: its term is the whole loss

    plain = tmp_path / "no-aux"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(f"{checkpoint}/model.safetensors")
    raw = json.loads(open(f"{checkpoint}/config.json").read())
    (plain / "config.json").write_text(json.dumps({**raw, "output_router_logits": False}))
    with_aux, without = layout_outputs(checkpoint, batch=BATCH), layout_outputs(str(plain), batch=BATCH)
    assert relative_error(without.embedding_grad, with_aux.embedding_grad)[1] > 1e-4


@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_gemm_and_per_expert_paths_agree(grouped):
    from shiftlm.comm import SINGLE
    from shiftlm.model.moe import SparseMoE, grouped_mm_supported

    config = ModelConfig(
        model_type="qwen2_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=16,
    )
    torch.manual_seed(0)
    moe = SparseMoE(config, SINGLE, SINGLE)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    x = torch.randn(3, 5, config.hidden_size, requires_grad=True)
    moe.grouped = False
    reference = moe(x)
    (ref_grad,) = torch.autograd.grad(reference.square().sum(), x)
    if grouped and not grouped_mm_supported(x, moe.experts["0"].gate_proj.weight.unsqueeze(0)):
        pytest.skip("torch._grouped_mm is not available for fp32 on this platform")
    moe.grouped = grouped
    out = moe(x)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    _assert_close("output", out, reference)
    _assert_close("input grad", grad, ref_grad)


def _export(checkpoint, target):
    from shiftlm.mesh import Mesh
    from shiftlm.model import build_model
    from shiftlm.model.weights import save_hf_checkpoint

    config = ModelConfig.from_hf(checkpoint)
    mesh = Mesh(ParallelConfig(dp=2, tp=2, ep=2))
    save_hf_checkpoint(build_model(config, mesh, checkpoint=checkpoint), target)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_export_at_ep2_tp2_round_trips(ranks, tiny_checkpoints, tmp_path, family):
    """Saved from an ep2 x tp2 layout: every tensor and config field as transformers wrote them, and
    transformers loads the result to the same model."""
    from transformers import AutoModelForCausalLM

    checkpoint, target = tiny_checkpoints[family], tmp_path / "export"
    ranks.run(4, _export, checkpoint, str(target))
    original = load_file(f"{checkpoint}/model.safetensors")
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    saved = {}
    for file in set(index.values()):
        saved.update(load_file(target / file))
    assert saved.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name
    assert ModelConfig.from_hf(target) == ModelConfig.from_hf(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    hf_original = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.arange(12).view(1, 12)
    assert torch.equal(hf(ids).logits, hf_original(ids).logits)


def test_bad_moe_layouts_name_the_fix():
    mixtral = ModelConfig(
        model_type="mixtral", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
    )
    with pytest.raises(ConfigError, match="ep = 3 must divide num_experts = 8"):
        ParallelConfig(dp=3, ep=3).check_model(mixtral)
    with pytest.raises(ConfigError, match=r"ep = 4 must divide the data-parallel ranks dp\*cp\*sp = 2"):
        ParallelConfig(dp=2, ep=4).check_model(mixtral)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        ParallelConfig(dp=2, ep=2).check_model(ModelConfig())
    with pytest.raises(ConfigError, match="num_experts_per_tok = 9 must be between 1 and num_experts = 8"):
        ModelConfig(model_type="mixtral", num_experts=8, num_experts_per_tok=9, moe_intermediate_size=32)
    narrow = ModelConfig(
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=6,
        intermediate_size=64,
    )
    with pytest.raises(
        ConfigError, match=r"tp = 4 \(which splits every expert too\) must divide moe_intermediate"
    ):
        ParallelConfig(tp=4).check_model(narrow)


def test_verify_refuses_a_bad_ep_in_one_line_before_any_rank(tiny_checkpoints):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shiftlm.cli",
            "verify",
            "--model",
            tiny_checkpoints["qwen2-moe"],
            "--ep",
            "1,3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "ep = 3 must divide num_experts = 8" in result.stderr
    assert "Traceback" not in result.stderr and "reference:" not in result.stdout


def test_moe_configs_round_trip_through_config_json(tiny_checkpoints):
    for family in MOE_FAMILIES:
        config = ModelConfig.from_hf(tiny_checkpoints[family])
        assert config.is_moe and config.num_experts == 8 and config.num_experts_per_tok == 2
        assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    qwen2 = ModelConfig.from_hf(tiny_checkpoints["qwen2-moe"])
    assert not qwen2.is_moe_layer(0) and qwen2.is_moe_layer(1) and qwen2.shared_expert_intermediate_size == 48
    assert ModelConfig.from_hf(tiny_checkpoints["qwen3-moe"]).qk_norm
