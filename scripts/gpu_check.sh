#!/usr/bin/env bash
# The GPU check (docs/gpu_check.md): benchmarks/gpu_check.py, then the CUDA tests, on a lent CUDA machine.
#
#   bash scripts/gpu_check.sh fetch       # HERE, with network: the wheels the machine lacks, into .whl/
#   bash scripts/gpu_check.sh             # THERE (device tool, carry [".whl"]): install them, benchmark, test
#   bash scripts/gpu_check.sh --dry-run   # HERE: the same stages on tiny shapes on the CPU
#
# The machine has torch 2.11 (cu130) and transformers 5.17 and no network; the package needs transformers>=5.24,
# so its wheel travels in .whl/ (ignored through .git/info/exclude, never committed). Every stage has its own
# timeout and the whole run stays inside GPU_CHECK_BUDGET_S (default 420 s, so a rerun fits a 15-minute lease);
# logs, the table and the JSON go to $OUT (the device tool returns what is written there; at most 8 files) or to
# /tmp/gpu-check-out.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TRANSFORMERS_VERSION=5.24.0

fetch() {
    set -e
    local py="${PYTHON:-python3}" plat=()
    for n in 17 24 27 28; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
    plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    rm -rf .whl && mkdir -p .whl
    # transformers' requirements are met by the machine's packages (huggingface_hub, tokenizers, safetensors,
    # regex, tqdm, numpy, pyyaml, typer): only transformers travels.
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d .whl "transformers==$TRANSFORMERS_VERSION"
    unzip -p .whl/transformers-*.whl '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' || true
    ls -la .whl && du -sh .whl
}

if [ "${1:-}" = "fetch" ]; then
    fetch
    exit
fi
BENCH_ARGS=()
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    BENCH_ARGS=(--dry-run)
    DRY=1
    PYTHON_BIN="$ROOT/.venv/bin"
    [ -x "$PYTHON_BIN/python3" ] && export PATH="$PYTHON_BIN:$PATH"
fi

# GPU_CHECK_ARGS: extra arguments for benchmarks/gpu_check.py (e.g. "--stages library")
read -r -a EXTRA <<< "${GPU_CHECK_ARGS:-}"
BENCH_ARGS+=("${EXTRA[@]}")
START=$SECONDS
BUDGET="${GPU_CHECK_BUDGET_S:-420}"
OUTDIR="${OUT:-/tmp/gpu-check-out}"
mkdir -p "$OUTDIR"
SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
left() { echo $(( BUDGET - (SECONDS - START) )); }
stage() {  # stage NAME LIMIT_S LOG CMD...: run CMD under timeout, tee to LOG, record the exit status
    local name=$1 limit=$2 logfile=$3
    shift 3
    local avail
    avail=$(left)
    [ "$limit" -gt "$avail" ] && limit=$avail
    if [ "$limit" -lt 10 ]; then
        echo "$name: skipped (budget spent)" | tee -a "$SUMMARY"
        return 1
    fi
    echo "=== $name (timeout ${limit}s, $(( SECONDS - START ))s elapsed) ===" | tee -a "$logfile"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$logfile"
    local rc=${PIPESTATUS[0]}
    echo "$name: rc=$rc ($(( SECONDS - START ))s elapsed)$([ "$rc" = 124 ] && echo ' TIMED OUT')" | tee -a "$SUMMARY"
    return "$rc"
}

# 1. wheels -> /tmp/site, ahead of the machine's site-packages; the repo itself is importable from its root.
if [ "$DRY" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
    stage install 90 "$OUTDIR/env.log" python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
else
    [ "$DRY" = 1 ] && echo "install: dry run, this machine's packages" | tee -a "$SUMMARY" || echo "install: no .whl/ here (carry [\".whl\"] and run 'bash scripts/gpu_check.sh fetch' first)" | tee -a "$SUMMARY"
fi
export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# 2. what we run on
stage env 60 "$OUTDIR/env.log" bash -c '
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv
    nvidia-smi | head -15
    python3 -c "
import sys, torch, transformers
print(\"python\", sys.version.split()[0], sys.executable)
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available())
print(\"transformers\", transformers.__version__, transformers.__file__)
if torch.cuda.is_available():
    print(\"gpu\", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
for name in (\"bitsandbytes\", \"flash_attn\", \"peft\", \"accelerate\", \"huggingface_hub\", \"tokenizers\", \"safetensors\"):
    try:
        module = __import__(name)
        print(name, getattr(module, \"__version__\", \"?\"))
    except Exception as error:
        print(name, \"-\", type(error).__name__, str(error)[:120])
import hf_triforce
print(\"hf_triforce\", hf_triforce.__version__, hf_triforce.__file__)
"'

# 3. the benchmark first (what the lease is for): its own deadline inside what is left, keeping PYTEST_S for the
#    tests and 20 s for it to write its table
PYTEST_S="${GPU_CHECK_PYTEST_S:-100}"
BENCH_LIMIT=$(( $(left) - PYTEST_S ))
DEADLINE=$(( BENCH_LIMIT - 20 ))
[ "$DEADLINE" -lt 20 ] && DEADLINE=20
stage benchmark "$BENCH_LIMIT" "$OUTDIR/bench.log" python3 benchmarks/gpu_check.py --out "$OUTDIR" \
    --deadline-s "$DEADLINE" "${BENCH_ARGS[@]}"

# 4. the CUDA tests with what is left (fp32 greedy identity on CUDA, cache= read-only, seeded sampling)
stage pytest $(( $(left) - 5 )) "$OUTDIR/pytest.log" python3 -m pytest -q -rs -x -p no:cacheprovider tests/test_cuda.py

echo "total $(( SECONDS - START ))s" | tee -a "$SUMMARY"
echo
echo "===== summary ====="
cat "$SUMMARY"
echo
[ -f "$OUTDIR/gpu_table.md" ] && cat "$OUTDIR/gpu_table.md"
exit 0
