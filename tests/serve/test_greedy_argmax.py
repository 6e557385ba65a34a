"""Greedy rows come back from a 2-rank step as each rank's (max, argmax), not as logits (serve/worker/logits.py):
the same token as torch.argmax over the whole row (ties: the lowest id), and only for rows that need
nothing else of the logits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shiftlm.mesh import Coords
from shiftlm.serve.engine.scheduler import SchedulerConfig, ShiftPolicy
from shiftlm.serve.engine.sequence import SamplingParams
from shiftlm.serve.plan import Mode
from shiftlm.serve.worker.logits import best_of, logits_block, pack_max
from shiftlm.serve.worker.paged_attention import FlatBatch
from shiftlm.tools.tiny import make_tiny_checkpoint


@settings(max_examples=80, deadline=None)
@given(
    sp=st.integers(1, 3),
    tp=st.integers(1, 3),
    vocab_per_tp=st.integers(1, 9),
    padding=st.integers(0, 3),
    num_tokens=st.integers(1, 12),
    mode=st.sampled_from(list(Mode)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    data=st.data(),
)
def test_the_ranks_maxima_pick_torch_argmax_ties_nan_and_padding_included(
    sp, tp, vocab_per_tp, padding, num_tokens, mode, dtype, data
):
    padded_vocab = vocab_per_tp * tp
    vocab = max(1, padded_vocab - padding)
    sampled = data.draw(st.lists(st.integers(0, num_tokens - 1), min_size=1, max_size=8, unique=True))
    rows = torch.arange(num_tokens + (-num_tokens % sp))
    batch = FlatBatch(rows, rows, rows, (), torch.tensor(sorted(sampled)), num_tokens)
    samples = len(sampled)
    # few distinct values: ties everywhere; some -inf rows and NaNs
    choices = st.sampled_from([0.0, 1.0, 2.0, float("-inf"), float("nan")])
    values = data.draw(st.lists(choices, min_size=samples * padded_vocab, max_size=samples * padded_vocab))
    logits = torch.tensor(values, dtype=dtype).view(samples, padded_vocab)
    logits[:, vocab:] = 5.0  # padding columns beat every real one unless they are left out
    tops = []
    for rank_sp in range(sp):
        for rank_tp in range(tp):
            coords = Coords(0, 0, rank_sp, rank_tp)
            block = logits_block(batch.sample_rows, batch.token_ids.numel(), mode, coords, sp, vocab_per_tp)
            columns = slice(block.vocab_start, block.vocab_start + block.vocab_len)
            packed = pack_max(logits[block.sample_index, columns], block.vocab_start, vocab)
            assert packed.dtype == dtype and packed.element_size() * packed.shape[-1] == 16
            tops.append((block.vocab_start, block.sample_index, packed))
    value, column = best_of(tops, samples, torch.device("cpu"))
    expected = torch.argmax(logits[:, :vocab].float(), dim=-1)
    assert torch.equal(column, expected)
    picked = logits[torch.arange(samples), expected].double()
    assert torch.equal(value.isnan(), picked.isnan())
    assert torch.equal(value[~value.isnan()], picked[~picked.isnan()])


def test_argmax_only_is_exactly_the_requests_that_use_nothing_but_the_argmax():
    assert SamplingParams(temperature=0).argmax_only
    for other in (
        dict(temperature=0.7),
        dict(logprobs=0),
        dict(prompt_logprobs=1),
        dict(logit_bias=((3, 1.0),)),
        dict(min_tokens=1),
        dict(repetition_penalty=1.1),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=0.5),
        dict(n=2),
    ):
        assert not SamplingParams(**{"temperature": 0, **other}).argmax_only, other


REQUESTS = {  # name -> (prompt, params, argmax-only)
    "greedy": ([5, 17, 33, 2, 9, 100, 7], dict(temperature=0), True),
    "greedy2": ([240, 1, 77], dict(temperature=0), True),
    "logprobs": ([44, 3, 8, 19, 201], dict(temperature=0, logprobs=3), False),
    "seeded": ([9, 9, 31, 4], dict(temperature=0.9, top_k=20, seed=11), False),
    "bias": ([12, 13, 14], dict(temperature=0, logit_bias=((7, 3.0),)), False),
}


def run_mixed_batch(model_dir: str, tp: int, sp: int) -> dict | None:
    """Rank 0: the five requests in one engine; what each step's logits rows looked like."""
    from shiftlm.mesh import Mesh
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.engine.core import Engine
    from shiftlm.serve.worker.runner import ModelRunner
    from tests.serve.fakes import LetterTokenizer

    mesh = Mesh(ParallelConfig(tp=tp, sp=sp))
    runner = ModelRunner.load(model_dir, mesh, num_blocks=48, block_size=4)
    if mesh.rank != 0:
        runner.serve_steps()
        return None
    finite_per_row: dict[str, list[int]] = {}
    execute = runner.execute

    def recording_execute(plan):
        logits = execute(plan)
        row = 0
        for chunk in plan.chunks:
            if chunk.sample:
                name = engine.scheduler.sequence(chunk.seq_id).request_id
                finite = int(torch.isfinite(logits[row + chunk.num_logits_rows - 1]).sum())
                finite_per_row.setdefault(name, []).append(finite)
            row += chunk.num_logits_rows
        return logits

    runner.execute = recording_execute
    config = SchedulerConfig(
        num_blocks=48,
        block_size=4,
        max_tokens_per_step=16,
        max_model_len=64,
        policy=ShiftPolicy.named("shift", threshold=6),
    )
    engine = Engine(runner, config, LetterTokenizer(), eos_token_ids=set(), vocab_size=250)
    for name, (prompt, params, _) in REQUESTS.items():
        engine.add_request(name, prompt, SamplingParams(max_tokens=5, ignore_eos=True, **params))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.logprobs is not None:
                logprobs.setdefault(out.request_id, []).append(out.logprobs.logprob)
    runner.stop_workers()
    embed = runner.shift_model.model.model.embed_tokens
    table = None if embed.full_table is None else tuple(embed.full_table.shape)
    return {"tokens": tokens, "logprobs": logprobs, "finite": finite_per_row, "table": table}


@pytest.fixture(scope="module")
def mixed_runs(ranks, tmp_path_factory):
    model_dir = str(make_tiny_checkpoint(tmp_path_factory.mktemp("argmax"), "llama-gqa"))
    return {
        layout: ranks.run(tp * sp, run_mixed_batch, model_dir, tp, sp)[0]
        for layout, (tp, sp) in {"tp1": (1, 1), "tp2": (2, 1), "sp2": (1, 2)}.items()
    }


@pytest.mark.parametrize("layout", ["tp2", "sp2"])
def test_a_mixed_batch_gives_tp1s_tokens_and_logprobs(mixed_runs, layout):
    reference, run = mixed_runs["tp1"], mixed_runs[layout]
    assert run["tokens"] == reference["tokens"]
    assert run["tokens"]["greedy"] and len(run["logprobs"]["logprobs"]) == 5
    torch.testing.assert_close(run["logprobs"], reference["logprobs"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["tp2", "sp2"])
def test_only_argmax_rows_skip_the_full_logits(mixed_runs, layout):
    finite = mixed_runs[layout]["finite"]
    for name, (_, _, argmax_only) in REQUESTS.items():
        if argmax_only:  # every step sent its (max, argmax) only: one finite entry per row
            assert set(finite[name]) == {1}, name
        else:
            assert min(finite[name]) > 1, name
    assert min(mixed_runs["tp1"]["finite"]["greedy"]) > 1  # one rank: the full row, nothing to save


def test_tp_ranks_look_tokens_up_in_the_whole_embedding_table(mixed_runs):
    assert mixed_runs["tp2"]["table"] is not None and mixed_runs["tp2"]["table"][0] >= 250
    assert mixed_runs["tp1"]["table"] is None and mixed_runs["sp2"]["table"] is None  # nothing to sum
