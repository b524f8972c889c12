"""`hf-triforce serve` starting on its own local Ray cluster: its replicas run at the starting command's niceness
(not Ray's worker niceness, 15), and a start that fails ends the command with one line naming the cause."""

import os
import subprocess
import sys

import httpx

from .serving_util import ROOT, free_port, save_chat_model, start_server, stop_server


def test_replicas_run_at_the_niceness_of_the_command(tmp_path):
    save_chat_model(tmp_path)
    port = free_port()
    process = start_server([str(tmp_path), "--threads", "1"], port, tmp_path / "server.log", niceness=3)
    try:
        figures = httpx.get(f"http://127.0.0.1:{port}/v1/triforce/replica", timeout=30).json()
    finally:
        stop_server(process)
    assert figures["niceness"] == os.getpriority(os.PRIO_PROCESS, 0) + 3


def test_a_failed_start_is_one_line_naming_the_cause(tmp_path):
    save_chat_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"these are not weights" * 8)
    environment = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                   "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "hf_triforce", "serve", str(tmp_path), "--threads", "1", "--port",
                           str(free_port())], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hf-triforce serve: the replicas did not start (") and "SafetensorError" in last, last
    assert "Traceback" not in done.stderr
