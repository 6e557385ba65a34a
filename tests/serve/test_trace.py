import gzip
import json
import socket
import subprocess
import sys

import pytest

from shiftlm.data import trace_path
from shiftlm.serve.replay import RequestResult, summarize
from shiftlm.serve.trace import TraceRequest, load_trace, scale_trace, synthetic_prompt

AZURE_CODE = trace_path("azure_code")


def test_the_azure_code_trace_loads_in_arrival_order():
    requests = load_trace("azure_code")
    with gzip.open(AZURE_CODE, "rt") as handle:
        assert len(requests) == len(handle.read().splitlines()) - 1  # minus the header
    assert all(a.arrival <= b.arrival for a, b in zip(requests, requests[1:]))
    assert (requests[0].input_len, requests[0].output_len) == (4808, 10)


def test_jsonl_timestamps_are_milliseconds(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1500, "input_length": 10, "output_length": 3},
        {"timestamp": 0, "input_length": 4, "output_length": 1},
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    assert load_trace(path) == [TraceRequest(0.0, 4, 1), TraceRequest(1.5, 10, 3)]


def test_rate_scaling_gives_the_requested_mean_rate_and_lengths_are_clipped():
    requests = scale_trace(
        load_trace(AZURE_CODE), start=100, max_requests=50, rate=5.0, max_input=64, max_output=8
    )
    assert requests[0].arrival == 0.0
    assert requests[-1].arrival == pytest.approx(49 / 5.0)
    assert max(r.input_len for r in requests) == 64 and max(r.output_len for r in requests) <= 8
    assert min(r.output_len for r in requests) >= 1


def test_time_scale_multiplies_the_gaps():
    trace = [TraceRequest(10.0, 5, 5), TraceRequest(12.0, 5, 5), TraceRequest(20.0, 5, 5)]
    assert [r.arrival for r in scale_trace(trace, time_scale=0.5)] == [0.0, 1.0, 5.0]


def test_an_empty_slice_is_a_clear_error():
    with pytest.raises(ValueError, match="no requests"):
        scale_trace([TraceRequest(0.0, 1, 1)], start=5)


def test_synthetic_prompts_have_the_asked_length_and_differ_between_requests():
    assert len(synthetic_prompt(3, 17)) == 17 and synthetic_prompt(1, 4)[0] != synthetic_prompt(2, 4)[0]


def test_summary_counts_goodput_only_for_requests_within_both_slos():
    fast = RequestResult(0.0, 8, 5, ok=True, ttft=0.1, e2e=0.5, itls=[0.1] * 4)  # tpot 0.1
    slow_ttft = RequestResult(0.0, 8, 5, ok=True, ttft=3.0, e2e=3.4, itls=[0.1] * 4)
    slow_tpot = RequestResult(0.0, 8, 3, ok=True, ttft=0.1, e2e=1.1, itls=[0.5] * 2)  # tpot 0.5
    failed = RequestResult(0.0, 8, 5, error="HTTP 503")
    summary = summarize([fast, slow_ttft, slow_tpot, failed], duration=2.0, slo_ttft=1.0, slo_tpot=0.2)
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["goodput"] == 0.5  # only `fast`, over 2 s
    assert summary["output_token_throughput"] == (5 + 5 + 3) / 2.0
    assert summary["ttft"]["p50_ms"] == pytest.approx(100.0)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(max_requests=0), "--max-requests 0 must be >= 1"),
        (dict(max_input=0), "--max-input 0 must be >= 1"),
        (dict(max_output=-2), "--max-output -2 must be >= 1"),
        (dict(start=-1), "--start -1 must be >= 0"),
    ],
)
def test_a_limit_below_one_is_refused_not_read_as_no_limit(kwargs, words):
    """0 was read as "no limit" (`--max-requests 0` replayed the whole trace, `--max-input 0`
    clipped nothing), and a negative --start sliced from the trace's end."""
    with pytest.raises(ValueError, match=words):
        scale_trace(load_trace(AZURE_CODE), **kwargs)


def test_bench_serve_against_no_server_is_one_line(tmp_path):
    """An httpx.ConnectError traceback (29 lines) when nothing listened at --url; now one line naming
    the URL and the fixes, exit 2."""
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    command = [sys.executable, "-m", "shiftlm.cli", "bench", "serve", "--trace", "azure_code", "--url", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"no OpenAI server answers GET {url}/v1/models (ConnectError" in line, line
    assert "shiftlm serve --model DIR" in line and "--url" in line
