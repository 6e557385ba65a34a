"""A byte-level BPE tokenizer (Radford et al. 2019, GPT-2 §2.2) trained with HF `tokenizers`.

Saved in Hugging Face format (tokenizer.json + tokenizer_config.json with a ChatML chat template),
so `transformers.AutoTokenizer` and the server load it next to the exported model. Training on the
embedded corpus takes seconds; the result is cached on disk keyed by corpus content and vocab size.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from shiftlm.errors import DataError
from shiftlm.train.corpus import cache_dir, corpus_fingerprint, stdlib_corpus

END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, "<|im_start|>", "<|im_end|>"]

# ChatML, the format Qwen2 uses: each message is `<|im_start|>role\ncontent<|im_end|>\n`.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_bpe(documents: list[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Train a byte-level BPE on `documents` and save it in HF format into `out_dir` (atomically)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown token
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        bos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
    )
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    wrapped.save_pretrained(staging)
    if out_dir.exists():  # another process finished first; theirs is identical
        shutil.rmtree(staging)
    else:
        staging.rename(out_dir)
    return out_dir


def embedded_tokenizer(vocab_size: int = 2048, corpus_bytes: int = 4_000_000) -> Path:
    """The HF tokenizer dir trained on the stdlib corpus; built on first use, then read from cache."""
    documents = stdlib_corpus(corpus_bytes)
    key = f"stdlib-bpe-{vocab_size}-{corpus_fingerprint(documents)}"
    path = cache_dir() / "tokenizers" / key
    if not (path / "tokenizer.json").is_file():
        train_bpe(documents, vocab_size, path)
    return path


def read_tokenizer_json(path: str | Path):
    """The `tokenizer.json` of an HF tokenizer dir as a `tokenizers.Tokenizer`: what the data path
    needs (encode to ids, fast, no transformers import on every rank). Serving loads the whole HF
    tokenizer (chat template, special tokens) with `shiftlm.serve.engine.tokenizer.load_tokenizer`."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise DataError(f"{file} not found; data.tokenizer must name a dir holding an HF tokenizer.json")
    return Tokenizer.from_file(str(file))


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    """Copy an HF tokenizer dir's files (tokenizer.json, its config, chat template) next to a model."""
    for file in Path(src).iterdir():
        if file.is_file():
            shutil.copy2(file, Path(dst) / file.name)
