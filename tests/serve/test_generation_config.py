"""The model's generation_config.json as vLLM reads it (serve/generation_config.py): its sampling
values are the defaults of what a request leaves out, its eos_token_id ends samples, and
`--generation-config` / `--override-generation-config` choose and change them."""

from __future__ import annotations

import json

import pytest

from shiftlm.errors import ConfigError
from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.serve.generation_config import read_generation_config
from shiftlm.serve.http.protocol import ChatCompletionRequest, CompletionRequest
from shiftlm.tools.tiny import make_tiny_checkpoint

QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "eos_token_id": [3, 5],
             "do_sample": True, "max_new_tokens": 40, "pad_token_id": 0}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "tiny", "llama-gqa")
    write_char_tokenizer(path, vocab_size=256)
    (path / "generation_config.json").write_text(json.dumps(QWEN_LIKE))
    return path


def test_the_sampling_keys_and_eos_ids_are_read_and_the_override_goes_on_top(model_dir, tmp_path):
    auto = read_generation_config(str(model_dir))
    assert dict(auto.sampling) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 40
    }  # fmt: skip
    assert auto.eos_token_ids == (3, 5) and auto.source.endswith("generation_config.json")
    merged = read_generation_config(str(model_dir), "auto", '{"temperature": 0.2, "min_p": 0.1}')
    assert dict(merged.sampling)["temperature"] == 0.2 and dict(merged.sampling)["min_p"] == 0.1
    only = read_generation_config(str(model_dir), "vllm", {"top_p": 0.5})
    assert only.sampling == (("top_p", 0.5),) and only.eos_token_ids == ()
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3}')
    assert read_generation_config(str(model_dir), str(tmp_path)).sampling == (("temperature", 0.3),)
    assert read_generation_config(str(tmp_path / "nothing-here"), "auto").sampling == ()


@pytest.mark.parametrize(
    "choice,override,words",
    [
        ("vllm", "{", "--override-generation-config is not JSON"),
        ("vllm", '{"beam_width": 2}', "unknown key(s) beam_width"),
        ("vllm", '{"top_k": 2.5}', "top_k must be an integer"),
        ("/no/such/dir", None, "is not auto, vllm or a directory"),
    ],
)
def test_bad_generation_config_options_are_one_line_errors(model_dir, choice, override, words):
    with pytest.raises(ConfigError) as err:
        read_generation_config(str(model_dir), choice, override)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_server_setup_takes_the_defaults_and_the_eos_ids_and_checks_them(model_dir, tmp_path):
    from shiftlm.serve.options import ServeOptions

    setup = ServeOptions(model=str(model_dir), device="cpu").resolve({})
    assert dict(setup.api.sampling_defaults)["top_k"] == 20
    assert {3, 5} <= setup.eos_token_ids
    plain = ServeOptions(model=str(model_dir), device="cpu", generation_config="vllm").resolve({})
    assert plain.api.sampling_defaults == () and not {3, 5} & plain.eos_token_ids
    with pytest.raises(ConfigError, match="temperature must be in"):
        ServeOptions(
            model=str(model_dir), override_generation_config='{"temperature": 7}'
        ).generation_defaults()


def test_a_request_takes_the_defaults_of_what_it_leaves_out_only():
    defaults = (("temperature", 0.7), ("top_k", 20), ("max_tokens", 40))
    sent = CompletionRequest(model="m", prompt="hi", temperature=1.0, top_p=None)  # null: not sent
    params = sent.sampling_params(16, None, None, defaults=defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 20, 16)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.sampling_params(16, None, None, defaults=defaults).temperature == 0.7


def test_the_offline_api_uses_the_models_defaults(model_dir):
    from shiftlm import LLM

    with LLM(str(model_dir), enforce_eager=True, seed=0) as llm:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.7, 0.8, 20, 40)
        outs = [out.outputs[0] for out in llm.generate(["hello", "abc", "xyz", "q"])]  # the model's params
    # 40 tokens unless EOS came first (vLLM's own default would stop at 16)
    assert all(
        len(o.token_ids) == 40 if o.finish_reason == "length" else o.finish_reason == "stop" for o in outs
    )
    assert any(o.finish_reason == "length" for o in outs)
