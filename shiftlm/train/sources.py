"""Turn a data source into pre-tokenized binary shards (the only thing training reads).

Sources: the embedded stdlib corpus, local text files (one document each), JSONL and parquet
records (the `text_key` field), or pre-tokenized `.bin` shards (raw little-endian token ids, the
nanoGPT layout; dtype from a `meta.json` next to them, else uint16). Text is tokenized once, with an
end-of-text token after every document, into a cache dir keyed by the inputs, and written atomically.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from shiftlm.errors import DataError
from shiftlm.train.corpus import cache_dir, corpus_fingerprint, stdlib_corpus
from shiftlm.train.tokenizer import END_OF_TEXT, read_tokenizer_json

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}
RECORD_SUFFIXES = {".jsonl", ".parquet"}
SHARD_SUFFIX = ".bin"
_DOCS_PER_BATCH = 256


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def source_files(source: str) -> list[Path]:
    """The data files under `source` (a file or a dir, searched recursively), in sorted order."""
    path = Path(source)
    if not path.exists():
        raise DataError(
            f"data.source {source!r} does not exist; give a file or dir of text/JSONL/parquet/.bin"
        )
    candidates = sorted(path.rglob("*")) if path.is_dir() else [path]
    known = TEXT_SUFFIXES | RECORD_SUFFIXES | {SHARD_SUFFIX}
    files = [p for p in candidates if p.is_file() and p.suffix in known]
    if not files:
        raise DataError(f"no data files in {source!r}; expected {', '.join(sorted(known))}")
    return files


def _documents(files: list[Path], text_key: str) -> Iterator[str]:
    for file in files:
        if file.suffix in TEXT_SUFFIXES:
            yield file.read_text(encoding="utf-8", errors="replace")
        elif file.suffix == ".jsonl":
            for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(
                        f"{file}:{number} is not a JSON record ({err}); fix or remove it"
                    ) from None
                if text_key not in record:
                    raise DataError(f"{file}:{number} has no '{text_key}' field; set data.text_key")
                yield record[text_key]
        elif file.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError("reading parquet needs pyarrow: pip install pyarrow") from None
            table = pq.read_table(file)
            if text_key not in table.column_names:
                raise DataError(
                    f"{file} has no '{text_key}' column (has {table.column_names}); set data.text_key"
                )
            yield from table.column(text_key).to_pylist()


def _write_shards(documents: Iterator[str], tokenizer_dir: str, out_dir: Path) -> Path:
    """Tokenize `documents` into out_dir/tokens.bin + meta.json, via a temp dir renamed at the end."""
    tokenizer = read_tokenizer_json(tokenizer_dir)
    eot = tokenizer.token_to_id(END_OF_TEXT)
    dtype = token_dtype(tokenizer.get_vocab_size())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    count = 0
    with open(staging / "tokens.bin", "wb") as sink:
        batch: list[str] = []
        for document in [*documents, None]:
            if document is not None:
                batch.append(document)
            if batch and (document is None or len(batch) == _DOCS_PER_BATCH):
                for encoding in tokenizer.encode_batch(batch):
                    ids = np.asarray([*encoding.ids, eot], dtype=dtype)
                    sink.write(ids.tobytes())
                    count += len(ids)
                batch = []
    meta = {"dtype": dtype.name, "vocab_size": tokenizer.get_vocab_size(), "tokens": count}
    (staging / "meta.json").write_text(json.dumps(meta))
    if out_dir.exists():  # prepared concurrently by another process; identical content
        shutil.rmtree(staging)
    else:
        staging.rename(out_dir)
    return out_dir


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def prepare_shards(
    source: str, tokenizer_dir: str, text_key: str = "text", corpus_bytes: int = 0
) -> list[Path]:
    """The `.bin` shard files for `source`, tokenizing (and caching) text sources first.

    Call on one process per machine (then barrier): the others reuse the cache it leaves.
    """
    tokenizer_hash = hashlib.sha256(Path(tokenizer_dir, "tokenizer.json").read_bytes()).hexdigest()[:16]
    if source == "stdlib":
        documents = stdlib_corpus(corpus_bytes)
        out = cache_dir() / "data" / f"stdlib-{corpus_fingerprint(documents)}-{tokenizer_hash}"
        if not (out / "meta.json").is_file():
            _write_shards(iter(documents), tokenizer_dir, out)
        return [out / "tokens.bin"]
    files = source_files(source)
    shards = [f for f in files if f.suffix == SHARD_SUFFIX]
    if shards:
        if len(shards) != len(files):
            raise DataError(f"{source!r} mixes .bin shards with text files; keep them in separate dirs")
        return shards
    stamp = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    out = cache_dir() / "data" / f"files-{_key(stamp, text_key, tokenizer_hash)}"
    if not (out / "meta.json").is_file():
        _write_shards(_documents(files, text_key), tokenizer_dir, out)
    return [out / "tokens.bin"]


def shard_dtype(shard: Path) -> np.dtype:
    """The token dtype of a shard: from meta.json beside it, else uint16 (the nanoGPT convention)."""
    meta = shard.parent / "meta.json"
    return np.dtype(json.loads(meta.read_text())["dtype"]) if meta.is_file() else np.dtype(np.uint16)
