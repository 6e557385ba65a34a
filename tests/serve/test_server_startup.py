"""`shiftlm serve` startup failures: one clear line, the right exit code, and the log in the error."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from shiftlm.model.tiny import make_tiny_checkpoint
from shiftlm.serve.local_server import ServerStartError, local_server
from shiftlm.serve.tokenizer import write_char_tokenizer


def test_a_taken_http_port_is_a_one_line_error_with_exit_code_2(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path / "tiny", "llama-gqa")
    write_char_tokenizer(model_dir, vocab_size=250)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "shiftlm.cli", "serve", "--model", str(model_dir), "--sp", "2"]
        done = subprocess.run([*command, "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "choose another --port (0 picks a free one)"
    ]


def test_local_server_reports_the_servers_own_error_when_it_exits_early(tmp_path):
    with pytest.raises(ServerStartError, match=r"exited with code 2(.|\n)*error: .*config.json"):
        with local_server(["--model", str(tmp_path / "missing")], timeout=60):
            pass
