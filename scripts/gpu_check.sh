#!/usr/bin/env bash
# The GPU check (docs/gpu_check.md): CUDA tests + benchmarks/gpu_check.py on a lent CUDA machine.
#
#   bash scripts/gpu_check.sh fetch   # HERE, with network: the wheels the machine lacks, into .whl/
#   bash scripts/gpu_check.sh         # THERE (device tool, carry [".whl"]): install them, test, benchmark
#
# The machine has torch 2.11 (cu130), transformers 5.17, no network; we need transformers>=5.24, so the
# wheels travel in .whl/ (ignored through .git/info/exclude, never committed). Every stage has its own
# timeout and the whole run stays inside GPU_CHECK_BUDGET_S (default 420 s); logs, the table and the JSON
# go to $OUT (the device tool returns what is written there; at most 8 files) or to /tmp/gpu-check-out.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TRANSFORMERS_VERSION=5.24.0
BNB_VERSION=0.50.2

fetch() {
    set -e
    local py="${PYTHON:-python3}" plat=()
    for n in 17 24 27 28; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
    plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    rm -rf .whl && mkdir -p .whl
    dl() {  # dl DIR NAME==VERSION
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${plat[@]}" -d "$1" "$2"
    }
    # transformers 5.24's requirements are met by the machine's packages (huggingface_hub 1.33,
    # tokenizers 0.23.2, safetensors 0.8.0, regex/tqdm/numpy/pyyaml/typer present): only transformers travels.
    dl .whl "transformers==$TRANSFORMERS_VERSION"
    # bitsandbytes ships one library per CUDA/ROCm/XPU runtime (43 MB); the machine's torch is cu130, so keep
    # the CPU and CUDA 13.x libraries only (7 MB), dropping the others from the wheel and its RECORD.
    local tmp
    tmp="$(mktemp -d)"
    dl "$tmp" "bitsandbytes==$BNB_VERSION"
    "$py" - "$tmp"/bitsandbytes-*.whl .whl <<'EOF'
import re, sys, zipfile
from pathlib import Path
src, dest = Path(sys.argv[1]), Path(sys.argv[2]) / Path(sys.argv[1]).name
drop = re.compile(r"bitsandbytes/libbitsandbytes_(rocm|xpu|cuda1[0-2])\w*\.so$")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if drop.search(info.filename):
            continue
        data = zin.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = "".join(l for l in data.decode().splitlines(True) if not drop.search(l.split(",")[0])).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"{dest.name}: {src.stat().st_size / 2**20:.1f} MiB -> {dest.stat().st_size / 2**20:.1f} MiB")
EOF
    rm -rf "$tmp"
    # flash-attn: PyPI has only its sdist (a CUDA build of an hour or more), so none travels; the flash tests skip.
    ls -la .whl && du -sh .whl
}

if [ "${1:-}" = "fetch" ]; then
    fetch
    exit
fi

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
if ls .whl/*.whl >/dev/null 2>&1; then
    stage install 90 "$OUTDIR/env.log" python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
else
    echo "install: no .whl/ here (carry [\".whl\"] and run 'bash scripts/gpu_check.sh fetch' first)" | tee -a "$SUMMARY"
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

# 3. the CUDA tests (greedy identity in fp32 on CUDA, cache= read-only, seeded sampling; flash route if present)
stage pytest 150 "$OUTDIR/pytest.log" python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py

# 4. the benchmark: its own deadline 25 s inside what is left, so it ends writing its table
BENCH_LIMIT=$(( $(left) - 5 ))
DEADLINE=$(( BENCH_LIMIT - 25 ))
[ "$DEADLINE" -lt 30 ] && DEADLINE=30
stage benchmark "$BENCH_LIMIT" "$OUTDIR/bench.log" python3 benchmarks/gpu_check.py --out "$OUTDIR" \
    --deadline-s "$DEADLINE" "$@"

echo "total $(( SECONDS - START ))s" | tee -a "$SUMMARY"
echo
echo "===== summary ====="
cat "$SUMMARY"
echo
[ -f "$OUTDIR/gpu_table.md" ] && cat "$OUTDIR/gpu_table.md"
exit 0
