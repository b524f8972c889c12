"""A tiny random-weight chat model saved to a folder (what `hf-triforce serve` loads in the serving tests), and the
server process started from this checkout."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from hf_triforce_bench import server_process as process

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


def start_server(args: list[str], port: int, log: Path, timeout: float = 150.0, niceness: int = 0) -> subprocess.Popen:
    """``hf-triforce serve ARGS --port PORT`` from this checkout (`process.start_server`), Ray's token
    authentication off on this one-machine test cluster."""
    return process.start_server(args, port, log, timeout, cwd=ROOT, env={"RAY_AUTH_MODE": "disabled"},
                                niceness=niceness)


stop_server = process.stop_server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
