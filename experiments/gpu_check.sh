#!/usr/bin/env bash
# The one prepared command for a GPU machine (run from the repo root: `bash experiments/gpu_check.sh`,
# under the device tool's 600 s limit per call and 15 minutes in all). Every step runs under its own
# limit (`timeout` plus a kill grace), printed when the step starts; the worst case is their sum,
# printed first (391 s, under 400 s: room for a rerun within one lease; the outside step's 45 s were
# taken from the others: probe 20 -> 15, pytest 67 -> 60, validate 80 -> 72, search 140 -> 120,
# async 40 -> 37, nvidia-smi 8 -> 6). The steps:
#   env       nvidia-smi, python/torch/torchvision/optuna versions, CUDA visibility
#   outside   experiments/gpu_outside.py, first (the card idle): memory outside the caching allocator
#             after CUDA init, cuBLAS, cuBLASLt, cuDNN and two training steps (NVML used, mem_get_info,
#             reserved), and every cuDNN workspace request of 6 GPUMemNet-shaped convolutions against
#             oomtune's prediction (rules implicit and gemm); gpu_outside.json (its markdown is printed
#             into the log: `gpu_outside.py --render gpu_outside.json` writes it again)
#   pytest    the CUDA-marked tests: python -m pytest -m cuda
#   validate  experiments/gpu_validate.py: snapshot replay + meta prediction vs the device
#   search    experiments/gpu_search.py: oomtune search on ResNet-50 at budget=0.99 (a near-full budget),
#             objective throughput: 2 finalists and the baseline, 3 clean runs each, interleaved on one
#             GPU over time windows; the settings check of every trial
#   async     experiments/gpu_async_trial.py: one trial with backend:cudaMallocAsync (spawned), budget 0.99
# oomtune itself is not installed there (no network for pip): PYTHONPATH is the repo, absolute, so that
# trial processes started in other directories import it too. Logs and results go to
# experiments/results/; when $OUT is set, at most 8 files are copied there (the device tool brings
# back 8), after every step: the whole log, the outside step's JSON, the validation table and JSON,
# the search's JSON and best.yaml, the async trial's JSON, and gpu_trials.json: EVERY trial record
# (each trial directory's result.json, the search's and the async trial's) in one file.
# Local dry run on CPU: GPU_CHECK_DEVICE=cpu GPU_CHECK_RESULTS=/tmp/gc bash experiments/gpu_check.sh
# GPU_CHECK_STEPS (default "outside pytest validate search async"; "" = environment only) selects steps.
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
DEVICE=${GPU_CHECK_DEVICE:-cuda}
R=${GPU_CHECK_RESULTS:-$REPO/experiments/results}
STEPS=${GPU_CHECK_STEPS-outside pytest validate search async}
PY=${PYTHON:-python}
mkdir -p "$R"
FILES="gpu_check.log gpu_outside.json gpu_validate.md gpu_validate.json gpu_search.json gpu_search_best.yaml gpu_async_trial.json gpu_trials.json"

# Limits in seconds: each step's `timeout`, and the grace before SIGKILL (-k). The worst case is the sum
# of every limit and grace (the two collections of trial records included).
KILL=5
LIMIT_SMI=6
LIMIT_PROBE=15
LIMIT_OUTSIDE=40
LIMIT_PYTEST=60
LIMIT_VALIDATE=72
LIMIT_SEARCH=120
LIMIT_ASYNC=37
LIMIT_COLLECT=5
WORST=$((LIMIT_SMI + 2 + LIMIT_PROBE + 2 + LIMIT_OUTSIDE + KILL + LIMIT_PYTEST + KILL + LIMIT_VALIDATE + KILL + LIMIT_SEARCH + KILL \
         + LIMIT_ASYNC + KILL + 2 * (LIMIT_COLLECT + 1)))

collect_trials() {
    # every trial record under the results directory (the search's trials/trial-NNNN/result.json, the
    # async trial's), in one JSON object keyed by its directory, so that $OUT's 8 files hold them all
    timeout -k 1 "$LIMIT_COLLECT" "$PY" - "$R" <<'EOF' || echo "collecting trial records failed (rc $?)"
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
records = {}
for path in sorted(root.glob("gpu_search/trials/*/result.json")) + sorted(root.glob("gpu_async/*/result.json")):
    try:
        records[str(path.parent.relative_to(root))] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        records[str(path.parent.relative_to(root))] = {"unreadable": str(exc)}
(root / "gpu_trials.json").write_text(json.dumps(records, indent=1))
print(f"== trial records: {len(records)} copied into gpu_trials.json")
EOF
}

copy_out() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT"
    for f in $FILES; do
        if [ -f "$R/$f" ]; then cp "$R/$f" "$OUT/$f"; fi
    done
}

# The first lines of every log written here, made once at the start (experiments/_provenance.py: command,
# commit, date, machine, load); with uncommitted changes it prints one line and the check stops (exit 2).
HEADER=$("$PY" experiments/_provenance.py --command "bash experiments/gpu_check.sh") || exit 2
hdr() {
    printf '%s\n' "$HEADER"
}

want() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

step_env() {
    echo "== gpu_check: $(date -u +%FT%TZ) on $(hostname), device=$DEVICE, repo $REPO"
    echo "== step env (limit $((LIMIT_SMI + 2 + LIMIT_PROBE + 2)) s: nvidia-smi $LIMIT_SMI s, probe $LIMIT_PROBE s)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        timeout -k 2 "$LIMIT_SMI" nvidia-smi || echo "nvidia-smi failed (rc $?)"
    else
        echo "nvidia-smi: not found"
    fi
    timeout -k 2 "$LIMIT_PROBE" "$PY" - <<'EOF' || echo "version probe failed (rc $?)"
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

step_outside() {
    echo "== step outside: gpu_outside.py (limit $LIMIT_OUTSIDE s + $KILL s)"
    rm -f "$R/gpu_outside.json" "$R/gpu_outside.md"   # a run ended at its limit leaves none, not an old one
    timeout -k "$KILL" "$LIMIT_OUTSIDE" "$PY" experiments/gpu_outside.py --device "$DEVICE" --out-dir "$R" \
        --child-timeout $((LIMIT_OUTSIDE - 15)) 2>&1
    echo "== outside: rc $? (1 = a step or layer not measured, 124 = timed out)"
    if [ -f "$R/gpu_outside.md" ]; then cat "$R/gpu_outside.md"; fi
}

step_pytest() {
    echo "== step pytest: python -m pytest -m cuda (limit $LIMIT_PYTEST s + $KILL s)"
    hdr > "$R/gpu_pytest.log"
    timeout -k "$KILL" "$LIMIT_PYTEST" "$PY" -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee -a "$R/gpu_pytest.log"
    echo "== pytest: rc ${PIPESTATUS[0]} (5 = none collected, 124 = timed out)"
}

step_validate() {
    echo "== step validate: gpu_validate.py (limit $LIMIT_VALIDATE s + $KILL s)"
    hdr > "$R/gpu_validate.log"
    timeout -k "$KILL" "$LIMIT_VALIDATE" "$PY" experiments/gpu_validate.py --device "$DEVICE" --out-dir "$R" \
        --budget-s $((LIMIT_VALIDATE - 15)) --child-timeout 30 2>&1 | tee -a "$R/gpu_validate.log"
    echo "== validate: rc ${PIPESTATUS[0]} (1 = a case produced no data, 124 = timed out)"
    if [ -f "$R/gpu_validate.md" ]; then cat "$R/gpu_validate.md"; fi
}

step_search() {
    echo "== step search: gpu_search.py, objective throughput, budget=0.99 (limit $LIMIT_SEARCH s + $KILL s)"
    hdr > "$R/gpu_search.log"
    # the CPU dry run trains on the CPU: smaller batches, no time window (its throughput decides nothing)
    local size="search.batch_size.high=64 search.window=1"
    # and a small virtual GPU: its trials hold their tensors in host memory, so 0.99 of the default
    # 80 GiB virtual device is refused on a smaller host (trial.execute's host-memory check)
    if [ "$DEVICE" = cpu ]; then size="search.batch_size.high=4 search.window=0 virtual_device_memory=512MiB"; fi
    # and, last (they replace the values before them), one clean run per finalist, one timed step per
    # trial and no confirmation run of the winner: each repeat and the confirmation are spawned processes
    # (a torch import each), and the CPU dry run checks the script and the trial records it leaves (the
    # sampler's forked trials', copied the same way), not the spread of CPU timings. Empty on a GPU: its
    # command is the one above.
    local cpu_only=""
    if [ "$DEVICE" = cpu ]; then cpu_only="search.repeats=1 trial.measure_steps=1 trial.confirm_steps=1 search.confirm=false"; fi
    # shellcheck disable=SC2086
    timeout -k "$KILL" "$LIMIT_SEARCH" "$PY" experiments/gpu_search.py --device "$DEVICE" --out-dir "$R" \
        --timeout $((LIMIT_SEARCH - 30)) --search-timeout 35 \
        search.objective=throughput budget=0.99 search.finalists=2 search.repeats=3 $size \
        search.n_trials=2 trial.measure_steps=3 trial.confirm_steps=3 trial.timeout=60 $cpu_only \
        2>&1 | tee -a "$R/gpu_search.log"
    echo "== search: rc ${PIPESTATUS[0]} (1 = no best.yaml or settings check FAIL, 124 = timed out)"
}

step_async() {
    echo "== step async: gpu_async_trial.py, one backend:cudaMallocAsync trial, budget 0.99 (limit $LIMIT_ASYNC s + $KILL s)"
    timeout -k "$KILL" "$LIMIT_ASYNC" "$PY" experiments/gpu_async_trial.py --device "$DEVICE" --out-dir "$R" \
        --timeout $((LIMIT_ASYNC - 10)) 2>&1
    echo "== async: rc $? (1 = the trial failed or the backend did not take effect, 124 = timed out)"
}

main() {
    local t0=$SECONDS
    echo "== worst case: $WORST s (every step's limit and kill grace; steps: env $STEPS)"
    step_env
    copy_out
    for s in outside pytest validate search async; do
        if want "$s"; then
            "step_$s"
            if [ "$s" = search ] || [ "$s" = async ]; then collect_trials; fi
            echo "== elapsed $((SECONDS - t0)) s"
            copy_out
        fi
    done
    echo "== gpu_check done in $((SECONDS - t0)) s"
}

{ hdr; main 2>&1; } | tee "$R/gpu_check.log"
copy_out
exit 0
