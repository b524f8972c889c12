"""A tiny random-weight chat model saved to a folder (what `hf-triforce serve` loads in the serving tests), and the
server process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .conftest import make_model
from .tokenizer_util import word_tokenizer

VOCAB = 96
# each message as its words between t0 and t1; the assistant's turn opens with t2
CHAT_TEMPLATE = ("{% for m in messages %}t0 {{ m['content'] }} t1 {% endfor %}"
                 "{% if add_generation_prompt %}t2{% endif %}")
ROOT = Path(__file__).resolve().parent.parent


def save_chat_model(folder: Path, seed: int = 0):
    """A tiny Llama (sharp logits, so that drafts are accepted) and its word tokenizer with a chat template, saved
    to ``folder``; returns ``(model, tokenizer)``."""
    model = make_model("llama-gqa", vocab_size=VOCAB, seed=seed, logit_scale=4.0)
    tokenizer = word_tokenizer(VOCAB)
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def start_server(args: list[str], port: int, log: Path, timeout: float = 150.0) -> subprocess.Popen:
    """``python -m hf_triforce serve ARGS --port PORT`` from this checkout, once ``/health`` answers."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    process = subprocess.Popen([sys.executable, "-m", "hf_triforce", "serve", *args, "--port", str(port)], cwd=ROOT,
                               env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
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


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM (the server shuts its local Ray cluster down), then SIGKILL of its process group if it lingers."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
