"""Every TP x SP layout computes the single-rank function, which is the Hugging Face function."""

import pytest

from shiftlm.tools.parity import layout_outputs, relative_error

TOLERANCE = 1e-5

# (tp, sp, megatron sequence parallel): tp in {1,2,4} x sp in {1,2}, tp=1 sp=4, and SP norm regions
LAYOUTS = [
    (1, 1, False),
    (2, 1, False),
    (4, 1, False),
    (1, 2, False),
    (2, 2, False),
    (4, 2, False),
    (1, 4, False),
    (2, 1, True),
    (2, 2, True),
]
FAMILIES = ["llama", "llama-gqa", "qwen2", "mistral"]


def _assert_close(name, ours, reference):
    abs_err, rel_err = relative_error(ours, reference)
    assert rel_err <= TOLERANCE, f"{name}: max abs {abs_err:.3g}, relative {rel_err:.3g} > {TOLERANCE}"


_single_rank = {}


def _one_rank(ranks, checkpoint):
    if checkpoint not in _single_rank:
        _single_rank[checkpoint] = ranks.run(1, layout_outputs, checkpoint, param_grads=True)[0]
    return _single_rank[checkpoint]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp,sp,sequence_parallel", LAYOUTS, ids=lambda v: str(v))
def test_layout_matches_hf_and_one_rank(
    ranks, tiny_checkpoints, hf_reference, family, tp, sp, sequence_parallel
):
    checkpoint = tiny_checkpoints[family]
    outputs = ranks.run(
        tp * sp,
        layout_outputs,
        checkpoint,
        tp=tp,
        sp=sp,
        sequence_parallel=sequence_parallel,
        param_grads=True,
    )
    ours = outputs[0]
    reference = hf_reference(family)
    single = _one_rank(ranks, checkpoint)
    _assert_close("logits vs HF", ours.logits, reference.logits)
    _assert_close("input-embedding grad vs HF", ours.embedding_grad, reference.embedding_grad)
    _assert_close("logits vs one rank", ours.logits, single.logits)
    _assert_close("input-embedding grad vs one rank", ours.embedding_grad, single.embedding_grad)
    assert ours.param_grads.keys() == single.param_grads.keys()
    for name, grad in ours.param_grads.items():
        _assert_close(f"{name} grad vs one rank", grad, single.param_grads[name])
        if name in reference.param_grads and name != "lm_head.weight":
            _assert_close(f"{name} grad vs HF", grad, reference.param_grads[name])
    # every rank ends with the same whole tensors
    for other in outputs[1:]:
        assert (other.logits == ours.logits).all()
