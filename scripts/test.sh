#!/usr/bin/env bash
# The test command: sets up .venv (first run installs everything), lints, runs the whole suite on the CPU.
HF_TRIFORCE_EXTRAS="test,deploy,assets,bench" source "$(dirname "$0")/env.sh"
ruff check hf_triforce tests examples benchmarks
python -m pytest -q "$@"
