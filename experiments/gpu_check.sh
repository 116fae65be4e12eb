#!/usr/bin/env bash
# The one prepared command for a GPU machine (run from the repo root: `bash experiments/gpu_check.sh`,
# under the device tool's 600 s limit). Worst case about 540 s; typically 5-6 minutes on an H200:
#   1. environment: nvidia-smi, python/torch/torchvision/optuna versions, CUDA visibility  (<= 45 s)
#   2. the CUDA-marked tests: python -m pytest -m cuda -q                                 (<= 80 s)
#   3. experiments/gpu_validate.py: snapshot replay + meta prediction vs the device        (<= 200 s)
#   4. experiments/gpu_search.py: oomtune search on ResNet-50, budget 16GiB, settings check (<= 215 s)
# oomtune itself is not installed there (no network for pip): PYTHONPATH is the repo, absolute,
# so that trial processes started in other directories import it too. Logs and results go to
# experiments/results/ (gpu_*.log, gpu_validate.md/.json, gpu_search.json, gpu_search_best.yaml);
# when $OUT is set, the same 8 files are copied there (flat names), after every step.
# Local dry run on CPU: GPU_CHECK_DEVICE=cpu GPU_CHECK_RESULTS=/tmp/gc bash experiments/gpu_check.sh
# GPU_CHECK_STEPS (default "pytest validate search"; "" = environment only) selects steps.
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
DEVICE=${GPU_CHECK_DEVICE:-cuda}
R=${GPU_CHECK_RESULTS:-$REPO/experiments/results}
STEPS=${GPU_CHECK_STEPS-pytest validate search}
PY=${PYTHON:-python}
mkdir -p "$R"
FILES="gpu_check.log gpu_pytest.log gpu_validate.log gpu_validate.md gpu_validate.json gpu_search.log gpu_search.json gpu_search_best.yaml"

copy_out() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT"
    for f in $FILES; do
        if [ -f "$R/$f" ]; then cp "$R/$f" "$OUT/$f"; fi
    done
}

# The first lines of every log written here: the exact command and the commit (issue 14 item 8).
hdr() {
    printf '# command: bash experiments/gpu_check.sh\n# commit: %s (uncommitted changes: %s)\n' \
        "$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)" \
        "$(if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]; then echo yes; else echo no; fi)"
}

want() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

step_env() {
    echo "== gpu_check: $(date -u +%FT%TZ) on $(hostname), device=$DEVICE, repo $REPO"
    if command -v nvidia-smi >/dev/null 2>&1; then
        timeout 20 nvidia-smi || echo "nvidia-smi failed (rc $?)"
    else
        echo "nvidia-smi: not found"
    fi
    timeout 25 "$PY" - <<'EOF' || echo "version probe failed (rc $?)"
import platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("torch", "torchvision", "optuna", "hydra", "rich", "pytest", "pynvml", "sortedcontainers"):
    try:
        mod = __import__(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        print(f"{name} MISSING ({type(exc).__name__}: {exc})")
import torch
print("cuda available", torch.cuda.is_available(), "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)
import oomtune
print("oomtune", oomtune.__version__, "from", oomtune.__file__)
EOF
}

step_pytest() {
    echo "== cuda tests: python -m pytest -m cuda -q (limit 75 s)"
    hdr > "$R/gpu_pytest.log"
    timeout -k 5 75 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee -a "$R/gpu_pytest.log"
    echo "== cuda tests: rc ${PIPESTATUS[0]} (5 = none collected, 124 = timed out)"
}

step_validate() {
    echo "== gpu_validate.py (limit 200 s)"
    hdr > "$R/gpu_validate.log"
    timeout -k 10 190 "$PY" experiments/gpu_validate.py --device "$DEVICE" --out-dir "$R" \
        --budget-s 165 --child-timeout 70 2>&1 | tee -a "$R/gpu_validate.log"
    echo "== gpu_validate: rc ${PIPESTATUS[0]} (1 = a case produced no data, 124 = timed out)"
    if [ -f "$R/gpu_validate.md" ]; then cat "$R/gpu_validate.md"; fi
}

step_search() {
    echo "== gpu_search.py (limit 215 s)"
    hdr > "$R/gpu_search.log"
    timeout -k 10 205 "$PY" experiments/gpu_search.py --device "$DEVICE" --out-dir "$R" --timeout 175 \
        2>&1 | tee -a "$R/gpu_search.log"
    echo "== gpu_search: rc ${PIPESTATUS[0]} (1 = no best.yaml or settings check FAIL, 124 = timed out)"
}

main() {
    local t0=$SECONDS
    step_env
    copy_out
    for s in pytest validate search; do
        if want "$s"; then
            "step_$s"
            echo "== elapsed $((SECONDS - t0)) s"
            copy_out
        fi
    done
    echo "== gpu_check done in $((SECONDS - t0)) s"
}

{ hdr; main 2>&1; } | tee "$R/gpu_check.log"
copy_out
exit 0
