"""`shiftlm serve` startup failures: one clear line, the right exit code, and the log in the error."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from shiftlm.serve.engine.tokenizer import write_char_tokenizer
from shiftlm.serve.local_server import ServerStartError, local_server
from shiftlm.tools.tiny import make_tiny_checkpoint


def test_a_taken_http_port_is_a_one_line_error_with_exit_code_2(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=250)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "shiftlm.cli", "serve", "--model", str(model_dir)]
        command += ["--sp", "2", "--device", "cpu"]  # a 2-rank CPU server, GPUs visible or not
        done = subprocess.run([*command, "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"shiftlm serve: error: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "choose another --port (0 picks a free one)"
    ]


def test_local_server_reports_the_servers_own_error_when_it_exits_early(tmp_path):
    with pytest.raises(ServerStartError, match=r"exited with code 3(.|\n)*error: .*config.json"):
        with local_server(["--model", str(tmp_path / "missing")], timeout=60):
            pass


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"


def test_vllm_style_command_line_api_key_default_name_and_chat_template(tmp_path, monkeypatch):
    """`shiftlm serve MODEL` (positional), SHIFTLM_API_KEY guarding /v1 (401 without it, /health
    open), the served name from the model argument (vLLM's default), and --chat-template as a string."""
    import httpx

    # the test extras install the client; a host without them (a bare GPU image) skips, not fails
    openai = pytest.importorskip("openai")
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=250)
    monkeypatch.setenv("SHIFTLM_API_KEY", "sekrit")
    log_path = tmp_path / "serve.log"
    args = [
        str(model_dir),
        "--tensor-parallel-size",
        "1",
        "--chat-template",
        TEMPLATE,
        "--log-interval",
        "0.5",
    ]
    with local_server(args, log_path=str(log_path)) as server:
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        denied = httpx.get(f"{server.url}/v1/models", timeout=30)
        assert denied.status_code == 401 and denied.json()["error"]["message"]
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekrit", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [str(model_dir)]
        out = client.chat.completions.create(
            model=str(model_dir), messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
        )
        assert out.usage.prompt_tokens == len("[user]hi[assistant]")
        nulls = {"model": str(model_dir), "prompt": "a", "max_tokens": 1, "temperature": None, "seed": None}
        headers = {"authorization": "Bearer sekrit"}
        assert (
            httpx.post(f"{server.url}/v1/completions", json=nulls, headers=headers, timeout=60).status_code
            == 200
        )
        time.sleep(1.0)
    log = log_path.read_text()
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log  # the access log
    assert "throughput: prompt" in log and "KV cache usage" in log  # the periodic line


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--max-model-len", "100000"], "--max-model-len 100000 must be in [2, 256]"),
        (["--dtype", "int8"], "--dtype 'int8' is not one of"),
        (["--model", "/elsewhere"], "two models given"),
        (["--spin-wait", "-1"], "--spin-wait -1.0 must be in [0, 1] seconds"),
        (["--speculative-config", '{"method": "eagle"}'], "method 'eagle' is not supported"),
    ],
    ids=["max-model-len", "dtype", "two-models", "spin-wait", "speculative-config"],
)
def test_bad_serve_flags_are_one_line_errors_with_exit_code_2(tmp_path, flags, message):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=250)
    command = [sys.executable, "-m", "shiftlm.cli", "serve", str(model_dir), "--port", "0", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("shiftlm serve: error: ") and message in line
