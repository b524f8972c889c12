#!/usr/bin/env bash
# The test command: sets up .venv (first run installs everything), lints, runs the suite on the CPU in parallel
# processes (pytest-xdist: one worker per core, one torch thread each: tests/conftest.py; a test file runs in one
# worker, so its module-scoped models and prefills are built once).
#   bash scripts/test.sh              the default tier (pyproject.toml: -m 'not extended')
#   bash scripts/test.sh --extended   the default tier and the extended tier (@pytest.mark.extended: long
#                                     enumerations and statistical runs)
# Either also runs the kernels' and exactness tests on the AVX2 build where the CPU has AVX-512 (below).
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
# The whole suite's run (no test named): the kernels' tests and the exactness tests that run through them once more
# on the AVX2 build, what an AVX2-only CPU runs (8-lane vectors; ATen held to AVX2 too), where this CPU has AVX-512
# and no build target is forced.
AVX2_TESTS=(tests/test_native_build.py tests/test_few_rows_linear.py tests/test_gguf_linear.py
            tests/test_cpu_attention.py tests/test_cpu_kernels.py tests/test_attention_routes.py
            tests/test_greedy_identity.py tests/test_gguf_weights.py tests/test_ragged_attention.py
            tests/test_continuous_batch.py)
if [ "${#ARGS[@]}" -eq 0 ] || [ "${ARGS[*]}" = "-m extended or not extended" ]; then
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null && [ -z "${HF_TRIFORCE_CPU_MARCH:-}" ]; then
        echo "the kernels' and exactness tests on the AVX2 build (HF_TRIFORCE_CPU_MARCH=x86-64-v3, ATEN_CPU_CAPABILITY=avx2)"
        HF_TRIFORCE_CPU_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 \
            python -m pytest -q -n auto --dist loadfile ${ARGS[@]+"${ARGS[@]}"} "${AVX2_TESTS[@]}"
    fi
fi
