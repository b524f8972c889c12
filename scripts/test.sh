#!/usr/bin/env bash
# The test command: sets up .venv (first run installs everything), lints, runs the suite on the CPU in parallel
# processes (pytest-xdist: one worker per core, one torch thread each: tests/conftest.py; a test file runs in one
# worker, so its module-scoped models and prefills are built once).
#   bash scripts/test.sh              the default tier (pyproject.toml: -m 'not extended')
#   bash scripts/test.sh --extended   the default tier and the extended tier (@pytest.mark.extended: long
#                                     enumerations and statistical runs)
# Every other argument goes to pytest (e.g. -n 0 for one process, -k NAME, a test file).
HF_TRIFORCE_EXTRAS="test,deploy,assets,bench,serve" source "$(dirname "$0")/env.sh"
ARGS=()
for arg in "$@"; do
    if [ "$arg" = "--extended" ]; then
        ARGS+=(-m "extended or not extended")  # overrides the default -m of pyproject.toml's addopts
    else
        ARGS+=("$arg")
    fi
done
ruff check hf_triforce hf_triforce_bench tests examples benchmarks
python -m pytest -q -n auto --dist loadfile ${ARGS[@]+"${ARGS[@]}"}
