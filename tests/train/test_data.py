from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.train.data import BatchPlan, BatchReader, SampleOrder, TokenDataset
from shiftlm.train.sources import DataError, prepare_shards
from shiftlm.train.tokenizer import embedded_tokenizer, read_tokenizer_json


@pytest.fixture(scope="module")
def tokenizer_dir():
    return str(embedded_tokenizer())


def _shard(tmp_path, tokens: int):
    path = tmp_path / "tokens.bin"
    np.arange(tokens, dtype=np.uint16).tofile(path)
    return [path]


def test_the_embedded_tokenizer_round_trips_python_source(tokenizer_dir):
    tokenizer = read_tokenizer_json(tokenizer_dir)
    text = "def add(a, b):\n    return a + b  # ünïcode\n"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    config = json.loads((embedded_tokenizer() / "tokenizer_config.json").read_text())
    assert (
        "im_start" in config.get("chat_template", "")
        or (embedded_tokenizer() / "chat_template.jinja").is_file()
    )


@settings(max_examples=20, deadline=None)
@given(
    dp=st.sampled_from([1, 2, 4]),
    micro=st.sampled_from([1, 2]),
    accumulation=st.sampled_from([1, 3]),
    step=st.integers(0, 50),
)
def test_dp_ranks_read_disjoint_shares_that_make_up_the_global_batch(dp, micro, accumulation, step):
    plan = BatchPlan(global_batch=dp * micro * accumulation, micro_batch=micro, dp_size=dp)
    shares = [sum(plan.positions(step, rank), []) for rank in range(dp)]
    everything = sorted(p for share in shares for p in share)
    assert everything == list(range(step * plan.global_batch, (step + 1) * plan.global_batch))


def test_sample_order_is_a_seeded_permutation_per_epoch():
    order = SampleOrder(10, seed=3)
    epoch0, epoch1 = [order[p] for p in range(10)], [order[p] for p in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    assert [SampleOrder(10, seed=3)[p] for p in range(10)] == epoch0


def test_targets_are_the_inputs_shifted_by_one(tmp_path):
    dataset = TokenDataset(_shard(tmp_path, 1000), seq_len=16)
    reader = BatchReader(dataset, BatchPlan(4, 2, 1), dp_rank=0, seed=0)
    for inputs, targets in reader.step(5):
        assert inputs.shape == targets.shape == (2, 16)
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])


def test_a_dataset_shorter_than_one_sample_is_refused(tmp_path):
    with pytest.raises(DataError, match="lower train.seq_len"):
        TokenDataset(_shard(tmp_path, 10), seq_len=16)


def test_text_jsonl_and_parquet_sources_tokenize_to_the_same_tokens(tmp_path, tokenizer_dir):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    documents = ["first document\n", "second one, longer: " + "x" * 50]
    (tmp_path / "text").mkdir()
    for i, doc in enumerate(documents):
        (tmp_path / "text" / f"{i}.txt").write_text(doc)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in documents))
    pq.write_table(pyarrow.table({"body": documents}), tmp_path / "d.parquet")
    tokens = []
    for source in (tmp_path / "text", tmp_path / "d.jsonl", tmp_path / "d.parquet"):
        shard = prepare_shards(str(source), tokenizer_dir, text_key="body")[0]
        tokens.append(np.fromfile(shard, dtype=np.uint16).tolist())
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) > 10


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({}, "no data files"),
        ({"a.jsonl": '{"other": 1}\n'}, "set data.text_key"),
    ],
)
def test_unusable_sources_get_clear_errors(tmp_path, tokenizer_dir, content, message):
    for name, text in content.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=message):
        prepare_shards(str(tmp_path), tokenizer_dir)
