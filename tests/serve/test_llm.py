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
    model.generation_config.eos_token_id = None  # as ignore_eos: EOS is a token like any other
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False)
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


TOOLS_TEMPLATE = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ messages[-1]['content'] }}"


def test_chat_renders_the_template_as_the_server_does(model_dir):
    """One conversation or a list of them; the prompt is the chat template's text, encoded without
    added special tokens (as /v1/chat/completions encodes it), and greedy replies equal
    `transformers.generate` on those ids."""
    from shiftlm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    talk = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    with LLM(str(model_dir)) as llm:
        one = llm.chat(talk, greedy)
        both = llm.chat([talk, parts], greedy)
        custom = llm.chat(talk, greedy, chat_template="{{ messages[-1]['content'] }}|")
        opened = llm.chat(
            [*talk, {"role": "assistant", "content": "ok"}],
            greedy,
            add_generation_prompt=False,
            continue_final_message=True,
        )
        tool = {"type": "function", "function": {"name": "f"}}
        with_tools = llm.chat(talk, greedy, tools=[tool], chat_template=TOOLS_TEMPLATE)
    assert one[0].prompt == "<system>be brief\n<user>hi\n<assistant>"
    assert both[1].prompt == "<user>hi\n<assistant>"  # text parts joined
    assert custom[0].prompt == "hi|"
    assert opened[0].prompt == "<system>be brief\n<user>hi\n<assistant>ok"  # left open to continue
    assert with_tools[0].prompt == "f;hi"  # the tools reach the template (nothing parses the reply)
    assert both[0].prompt_token_ids == one[0].prompt_token_ids
    for out in (one[0], both[1], custom[0]):
        assert out.outputs[0].token_ids == _reference(model_dir, out.prompt_token_ids, 5)


def test_chat_bad_input_names_the_message(model_dir):
    from shiftlm import LLM

    with LLM(str(model_dir)) as llm:
        with pytest.raises(InvalidRequest, match="message 1 is not a"):
            llm.chat([{"role": "user", "content": "a"}, "b"])
        with pytest.raises(InvalidRequest, match="conversation 1: a conversation is a non-empty list"):
            llm.chat([[{"role": "user", "content": "a"}], []])
        with pytest.raises(InvalidRequest, match="message 0: content is text or a list"):
            llm.chat([{"role": "user", "content": [{"type": "image_url"}]}])
        llm.tokenizer.chat_template = None
        with pytest.raises(InvalidRequest, match="no chat template: pass chat_template"):
            llm.chat([{"role": "user", "content": "a"}])
        assert not llm._engine.has_work()


def test_vllm_prompt_dicts_and_bad_prompt_types(model_dir):
    from shiftlm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM(str(model_dir)) as llm:
        ids = llm.tokenizer.encode("ab")
        outs = llm.generate([{"prompt": "ab"}, {"prompt_token_ids": ids}], greedy)
        single = llm.generate({"prompt_token_ids": ids}, greedy)
        with pytest.raises(InvalidRequest, match="prompt 1: a dict prompt has one key"):
            llm.generate(["a", {"text": "b"}])
        with pytest.raises(InvalidRequest, match="prompt 0 is a float"):
            llm.generate([1.5])
    assert outs[0].prompt == "ab" and outs[1].prompt is None
    assert llm.get_tokenizer() is llm.tokenizer  # vLLM's accessor
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == single[0].outputs[0].token_ids


def test_an_interrupted_batch_leaves_nothing_behind(model_dir):
    """Ctrl-C (or any error) in the middle of `generate` aborts its requests: the next call runs
    only its own prompts and gets the same tokens as on a fresh engine."""
    from shiftlm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(model_dir)) as llm:
        fresh = llm.generate(["hello", "ab"], greedy)
        engine_step, calls = llm._engine.step, []

        def step_then_interrupt():
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return engine_step()

        llm._engine.step = step_then_interrupt
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["cd", "ef", "gh"], SamplingParams(max_tokens=40, ignore_eos=True))
        llm._engine.step = engine_step
        assert not llm._engine.scheduler.has_work()
        again = llm.generate(["hello", "ab"], greedy)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in fresh]


def test_a_script_without_a_main_guard_starts_its_ranks(model_dir, tmp_path):
    """The README's example pasted into a file: `LLM(..., sp=2)` at top level, no `if __name__ ==
    "__main__":`. The spawned ranks must not re-run the script (they would build the LLM again and
    rank 0 would wait out the rendezvous timeout); it ends with the same tokens as in process."""
    import subprocess
    import sys

    script = tmp_path / "offline.py"
    script.write_text(
        "from shiftlm import LLM, SamplingParams\n"
        f"with LLM({str(model_dir)!r}, tp=1, sp=2) as llm:\n"
        "    out = llm.generate('ab', SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))\n"
        "    print('tokens', out[0].outputs[0].token_ids)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model_dir).encode("ab")
    assert f"tokens {_reference(model_dir, prompt, 4)}" in done.stdout


def test_max_tokens_none_runs_to_the_end_of_the_context(model_dir):
    """vLLM's `max_tokens=None`: as many tokens as the context leaves after each prompt."""
    from shiftlm import LLM, SamplingParams

    with LLM(str(model_dir), max_model_len=24, num_blocks=16, block_size=4) as llm:
        outs = llm.generate(["ab", "abcdef"], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
        # n samples share the cache (64 slots): each gets its share of what the prompt leaves
        shared = llm.generate(["ab"], SamplingParams(n=4, max_tokens=None, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [22, 18]
    assert {o.outputs[0].finish_reason for o in outs} == {"length"}
    assert [len(sample.token_ids) for sample in shared[0].outputs] == [(64 - 2) // 4] * 4


@pytest.mark.parametrize("layout", [dict(), dict(tp=1, sp=2)], ids=["1rank", "sp2-shift"])
def test_n_samples_of_a_sliding_window_model_are_each_its_own_sequence(tmp_path, layout):
    """The n samples run as one isolated group in the cache; each must attend as the one sequence of
    its own tokens, sliding window included (6 tokens here: a 16-token prompt and 20 new tokens pass
    it many times). Before the window joined the group's mask, sample 1 of 3 differed from the same
    seed run alone."""
    from shiftlm import LLM, SamplingParams

    path = make_tiny_checkpoint(tmp_path / "mistral", "mistral")
    write_char_tokenizer(path, vocab_size=256)

    def params(**kw):
        return SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, **kw)

    with LLM(str(path), **layout) as llm:
        group = llm.generate(["hello there, how"], params(n=3, seed=7))[0].outputs
        alone = [llm.generate(["hello there, how"], params(seed=7 + i))[0].outputs[0] for i in range(3)]
        with pytest.raises(InvalidRequest, match="timestep stream groups need a model without a sliding"):
            llm._engine.check_streams([1, 2], [[], []], [params(), params()], "timestep")
    assert [sample.token_ids for sample in group] == [sample.token_ids for sample in alone]
    assert len({tuple(sample.token_ids) for sample in group}) == 3
