"""The offline batch API (`shiftlm.LLM`): vLLM's way of writing it, the same engine as the server,
greedy tokens equal `transformers.generate`, bad input refused before anything runs."""

from __future__ import annotations

import pytest
import torch

from shiftlm.serve.engine.errors import InvalidRequest
from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.tools.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llm") / "tiny", "llama-gqa")
    write_char_tokenizer(path, vocab_size=256)
    return path


def _reference(model_dir, prompt_ids: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("layout", [dict(), dict(tp=1, sp=2)], ids=["1rank", "sp2-shift"])
def test_greedy_batch_equals_transformers_generate(model_dir, layout):
    from shiftlm import LLM, SamplingParams

    prompts = ["hello there", "ab", "The capital of France is"]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(model_dir), **layout) as llm:
        outputs = llm.generate(prompts, greedy)
        ids = [llm.tokenizer.encode(p) for p in prompts]
        again = llm.generate(ids[1], greedy)  # one prompt of token ids
    assert [out.prompt for out in outputs] == prompts
    for out, prompt_ids in zip(outputs, ids):
        assert out.prompt_token_ids == prompt_ids
        sample = out.outputs[0]
        assert sample.finish_reason == "length" and len(sample.token_ids) == 6
        assert sample.token_ids == _reference(model_dir, prompt_ids, 6)
    assert again[0].prompt is None and again[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_n_samples_per_prompt_and_one_params_per_prompt(model_dir):
    from shiftlm import LLM, SamplingParams

    with LLM(str(model_dir), seed=0) as llm:
        outs = llm.generate(
            ["ab", "cd"],
            [
                SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True),
                SamplingParams(max_tokens=2),
            ],
        )
        alone = llm.generate("ab", SamplingParams(temperature=1.0, seed=6, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs) for o in outs] == [3, 1]
    assert [s.index for s in outs[0].outputs] == [0, 1, 2]
    assert outs[0].outputs[1].token_ids == alone[0].outputs[0].token_ids  # sample i draws with seed + i


def test_bad_input_is_refused_before_anything_runs(model_dir):
    from shiftlm import LLM, SamplingParams

    with LLM(str(model_dir), max_model_len=32, num_blocks=16, block_size=4) as llm:
        with pytest.raises(
            InvalidRequest, match="prompt 1: the prompt has 40 tokens but the context holds 32"
        ):
            llm.generate(["ab", "x" * 40], SamplingParams(max_tokens=4))
        assert not llm._engine.has_work()  # nothing of the batch was queued
        with pytest.raises(InvalidRequest, match="2 SamplingParams for 3 prompts"):
            llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    with pytest.raises(TypeError, match="unknown options \\['no_such_flag'\\]"):
        LLM(str(model_dir), no_such_flag=1)
