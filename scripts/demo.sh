#!/usr/bin/env bash
# The demo command: sets up .venv, then runs `hf-triforce demo` on the bundled SmolLM2-135M (args pass through).
source "$(dirname "$0")/env.sh"
hf-triforce demo "$@"
