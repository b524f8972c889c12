"""`hf-triforce serve` in a child process: started and waited for until it answers, stopped with its local cluster.

What the serving tests and `benchmarks/serve_load.py` run: the real command, in a session of its own (so that a stop
reaches the Ray processes it starts), its output in a log file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(args: list[str], port: int, log: Path, timeout: float = 150.0, cwd: Path | None = None,
                 env: dict[str, str] | None = None, niceness: int = 0) -> subprocess.Popen:
    """``python -m hf_triforce serve ARGS --port PORT``, returned once ``GET /health`` answers 200. ``cwd``: a checkout
    to run from (first on ``PYTHONPATH``); ``env``: variables added to this process's environment; ``niceness``: added
    to this process's for the command. Raises RuntimeError with the log's tail where the server exits, or does not
    answer within ``timeout`` seconds (it is then stopped)."""
    environment = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    if cwd is not None:
        environment["PYTHONPATH"] = str(cwd)
    process = subprocess.Popen([sys.executable, "-m", "hf_triforce", "serve", *args, "--port", str(port)], cwd=cwd,
                               env=environment, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"hf-triforce serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(process)
    raise RuntimeError(f"hf-triforce serve did not answer within {timeout} s:\n{log.read_text()[-4000:]}")


def stop_server(process: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (the server shuts its local Ray cluster down), then SIGKILL of its process group if it lingers."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
