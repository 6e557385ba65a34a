"""`shiftlm serve` on a checkpoint in the format `shiftlm quickstart` exports (OUT/hf), without training.

The model is the quickstart's embedded `tiny` preset with a seeded init, written by the same core writer
(`save_hf_checkpoint`) with the same embedded BPE tokenizer and ChatML template beside it (what the
trainer copies into every checkpoint). The real quickstart trains for ~80 s; to serve its output:

    shiftlm quickstart --out runs/qs && shiftlm serve --model runs/qs/hf --tp 1 --sp 2 --port 8000
"""

from __future__ import annotations

import openai
import transformers

from shiftlm.model import build_model
from shiftlm.model.weights import save_hf_checkpoint
from shiftlm.serve.local_server import local_server
from shiftlm.train.config import DataSection
from shiftlm.train.setup import model_config
from shiftlm.train.tokenizer import END_OF_TEXT, copy_tokenizer, embedded_tokenizer, read_tokenizer_json

QUICKSTART_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}


def test_serve_answers_a_chat_completion_on_a_quickstart_format_checkpoint(tmp_path):
    data = DataSection()
    tokenizer_dir = embedded_tokenizer(data.vocab_size, int(data.corpus_mb * 1_000_000))  # cached after once
    bpe = read_tokenizer_json(tokenizer_dir)
    config, _ = model_config("tiny", bpe.get_vocab_size(), bpe.token_to_id(END_OF_TEXT))
    model_dir = tmp_path / "hf"
    save_hf_checkpoint(build_model(config, seed=0), model_dir)
    copy_tokenizer(tokenizer_dir, model_dir)
    assert QUICKSTART_FILES <= {path.name for path in model_dir.iterdir()}

    messages = [{"role": "user", "content": "def add(a, b):"}]
    template = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = template.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    with local_server(
        ["--model", str(model_dir), "--tp", "1", "--sp", "2", "--device", "cpu", "--model-name", "qs"]
    ) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="qs", messages=messages, max_tokens=8, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.usage.prompt_tokens == len(prompt_ids)  # the ChatML template was applied
    assert 1 <= out.usage.completion_tokens <= 8
    assert out.choices[0].finish_reason in ("length", "stop")
