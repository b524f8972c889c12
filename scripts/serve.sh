#!/usr/bin/env bash
# The server command: sets up .venv with the serve extra, then runs `hf-triforce serve` (args pass through, e.g.
# `bash scripts/serve.sh smollm2-135m --port 8000`; `--help` lists the options).
HF_TRIFORCE_EXTRAS="assets,bench,serve" source "$(dirname "$0")/env.sh"
hf-triforce serve "$@"
