"""`--shift-threshold auto`: the step size where SP x TP starts to win, measured through the runner."""

from __future__ import annotations

import re

import pytest

from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.serve.plan import Mode
from shiftlm.serve.worker.shift_probe import measure_shift_threshold, probe_plan


class CostedRunner:
    """Stands in for `runner.execute`: a step costs a fixed time per mode plus a time per token."""

    def __init__(self, tp: tuple[float, float], sp_tp: tuple[float, float]):
        self.costs = {Mode.TP: tp, Mode.SP_TP: sp_tp}
        self.plans = []
        self.clock = 0.0

    def execute(self, plan) -> None:
        self.plans.append(plan)
        fixed, per_token = self.costs[plan.mode]
        self.clock += fixed + per_token * plan.num_tokens

    def now(self) -> float:
        return self.clock


@pytest.fixture
def fake_clock(monkeypatch):
    """The probe's timer reads the fake runner's clock (deterministic, no sleeping)."""
    import shiftlm.serve.worker.shift_probe as probe

    holder = {}

    class Clock:
        @staticmethod
        def perf_counter() -> float:
            return holder["runner"].now()

    monkeypatch.setattr(probe, "time", Clock)
    return holder


def test_threshold_is_the_last_size_where_full_tp_still_wins(fake_clock):
    # TP: 1 ms + 0.10 ms/token; SP x TP: 5 ms + 0.05 ms/token: equal at 80 tokens, SP wins from 128 on
    runner = fake_clock["runner"] = CostedRunner((1e-3, 1e-4), (5e-3, 5e-5))
    threshold, rows = measure_shift_threshold(runner.execute, 512, block_size=16, num_blocks=512)
    assert threshold == 64
    assert [row["tokens"] for row in rows] == [16, 32, 64, 128, 256, 512]
    assert rows[0]["sp_tp_ms"] > rows[0]["tp_ms"] and rows[-1]["sp_tp_ms"] < rows[-1]["tp_ms"]


def test_when_sp_tp_never_wins_every_step_runs_full_tp(fake_clock):
    runner = fake_clock["runner"] = CostedRunner((1e-3, 1e-4), (2e-3, 1.01e-4))
    threshold, _ = measure_shift_threshold(runner.execute, 256, block_size=16, num_blocks=512)
    assert threshold == 256  # the step budget: no step is larger


def test_sp_tp_winning_from_the_smallest_step_gives_threshold_zero(fake_clock):
    runner = fake_clock["runner"] = CostedRunner((1e-3, 1e-4), (0.5e-3, 0.5e-4))
    threshold, _ = measure_shift_threshold(runner.execute, 256, block_size=16, num_blocks=512)
    assert threshold == 0


def test_a_win_inside_the_margin_does_not_switch(fake_clock):
    runner = fake_clock["runner"] = CostedRunner((1e-3, 1e-4), (0.99e-3, 0.99e-4))  # SP 1% faster
    threshold, _ = measure_shift_threshold(runner.execute, 256, block_size=16, num_blocks=512, margin=0.03)
    assert threshold == 256


class GlitchRunner(CostedRunner):
    """Full TP steps of `size` tokens are slow for their first `slow` runs (a busy moment of the host),
    then as the costs say."""

    def __init__(self, tp, sp_tp, size: int, slow: int):
        super().__init__(tp, sp_tp)
        self.size, self.slow = size, slow

    def execute(self, plan) -> None:
        super().execute(plan)
        if plan.mode is Mode.TP and plan.num_tokens == self.size and self.slow > 0:
            self.slow -= 1
            self.clock += 0.5  # far slower than either mode


def test_a_win_that_does_not_repeat_does_not_switch(fake_clock):
    # SP x TP is 1% slower everywhere, but the first timing of 256-token TP steps is disturbed
    runner = fake_clock["runner"] = GlitchRunner((1e-3, 1e-4), (1.01e-3, 1.01e-4), size=256, slow=8)
    threshold, rows = measure_shift_threshold(runner.execute, 512, block_size=16, num_blocks=512)
    assert threshold == 512
    glitched = next(row for row in rows if row["tokens"] == 256)
    assert (
        glitched["sp_tp_ms"] < glitched["tp_ms"] and glitched["confirm_sp_tp_ms"] > glitched["confirm_tp_ms"]
    )


def test_a_win_that_repeats_switches(fake_clock):
    runner = fake_clock["runner"] = CostedRunner((1e-3, 1e-4), (5e-3, 5e-5))
    threshold, rows = measure_shift_threshold(runner.execute, 512, block_size=16, num_blocks=512)
    assert (
        threshold == 64 and [("confirm_tp_ms" in row) for row in rows] == [False] * 3 + [True] + [False] * 2
    )


@pytest.mark.parametrize("tokens", [16, 100, 256, 2048])
def test_probe_plans_have_the_asked_tokens_and_stay_inside_the_cache(tokens):
    plan = probe_plan(tokens, Mode.SP_TP, block_size=16, num_blocks=300)
    assert plan.mode is Mode.SP_TP and plan.num_tokens == tokens
    blocks = [b for chunk in plan.chunks for b in chunk.new_blocks]
    assert len(blocks) == len(set(blocks)) and max(blocks) < 300
    for chunk in plan.chunks:  # every chunk's blocks hold its context plus its new tokens
        assert len(chunk.new_blocks) * 16 >= chunk.start + len(chunk.token_ids)


def test_a_cache_too_small_for_a_size_stops_the_probe_there(fake_clock):
    runner = fake_clock["runner"] = CostedRunner((1e-3, 1e-4), (2e-3, 2e-4))
    _, rows = measure_shift_threshold(runner.execute, 2048, block_size=16, num_blocks=120)
    assert rows[-1]["tokens"] < 2048
    assert all(max(b for c in p.chunks for b in c.new_blocks) < 120 for p in runner.plans)


def test_sp2_server_measures_its_threshold_at_startup(tmp_path):
    """The probe runs through a real 2-rank runner before the engine starts, and the startup line
    carries the measured token count (not 'auto'); the server then answers."""
    import httpx

    from shiftlm.serve.local_server import local_server
    from shiftlm.tools.tiny import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=250)
    log_path = tmp_path / "serve.log"
    with local_server(
        ["--model", str(model_dir), "--sp", "2", "--max-tokens-per-step", "128", "--device", "cpu"],
        log_path=str(log_path),
    ) as server:
        body = {"model": str(model_dir), "prompt": "hello", "max_tokens": 4, "temperature": 0}
        models = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
        body["model"] = models[0]["id"]
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    text = log_path.read_text()
    assert "shift threshold auto:" in text
    threshold = int(re.search(r"threshold=(\d+)", text).group(1))
    assert 0 <= threshold <= 128
    banner = next(line for line in text.splitlines() if line.startswith("shiftlm serve: "))
    if threshold >= 128:  # issue 36.5: the probe found SP x TP never faster: say full TP, no "shift"
        assert "mode=shift" not in banner and "every step runs full TP" in banner
        assert "tp x sp = 1 x 2" in banner
    else:
        assert f"mode=shift threshold={threshold}" in banner


def test_the_banner_says_what_runs_after_tp1_sp2():
    """Issue 36.5: when the probe finds SP x TP never faster (threshold = the step budget), the
    banner says every step runs full TP over tp x sp ranks, not "mode=shift threshold=256"."""
    from shiftlm.parallel import ParallelConfig
    from shiftlm.serve.server import describe_layout

    never = describe_layout(ParallelConfig(tp=1, sp=2), "shift", 256, 256)
    assert "mode=shift" not in never and "every step runs full TP" in never
    assert "all 2 ranks split every token's weights: tp x sp = 1 x 2" in never
    shifts = describe_layout(ParallelConfig(tp=1, sp=2), "shift", 64, 256)
    assert "mode=shift threshold=64" in shifts and "larger ones SP x TP" in shifts
    assert describe_layout(ParallelConfig(), "shift", 64, 256).endswith("one rank runs every step")
