#!/usr/bin/env bash
# Every CUDA check of dynabatch in one unattended command, on a GPU machine without network access.
#
#   bash benchmarks/gpu.sh                # install, then every check; about 5-10 minutes on one GPU
#   bash benchmarks/gpu.sh --dry-run      # print what it would run, run nothing, exit 0 (works on any machine)
#   bash benchmarks/gpu.sh --no-install --out /tmp/gpu
#
# What it runs, in order (each under its own time limit, its output in OUT/<step>.log):
#   install       pip install --no-deps --no-build-isolation -e .  (the machine has torch with CUDA,
#                 transformers, accelerate, pyarrow, numba, pytest, hypothesis, but none of the extras)
#   preflight     import dynabatch; a CUDA device is there
#   gpu-tests     the tests marked `gpu` (pytest -m gpu), only the files that hold some
#   inference     benchmarks/inference.py --device cuda   (encoder forward and greedy generate, every method)
#   memory-model  benchmarks/memory_model.py --device cuda (calibrate, plans, measured peaks on the GPU)
#   train-step    benchmarks/train_step.py --device cuda   (packed training steps, packed = padded loss)
#   overlap       benchmarks/overlap.py --device cuda      (a real encoder: streamed and built ahead vs in turn)
# and then prints one table: the hardware, and each check's status and time; the benchmarks' own
# tables follow, and are written to OUT/*.md.
#
# Models are built from configs with random weights; the text and tokenizer are the copies that
# travel with the repository (benchmarks/assets/, DYNABATCH_BENCH_ASSETS=repo), so nothing is
# downloaded. Exit status: 0 when every check passed, 1 otherwise.
#
# Environment: PYTHON (default python3); OUT (the output folder when --out is not given).

set -u -o pipefail

usage() {
    sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0"
    echo "Options: --dry-run, --no-install, --out DIR (default: \$OUT, else ./gpu-results), -h/--help"
}

DRY_RUN=0
INSTALL=1
OUT_DIR="${OUT:-gpu-results}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --no-install) INSTALL=0 ;;
        --out) shift; OUT_DIR="${1:?--out needs a folder}" ;;
        --out=*) OUT_DIR="${1#--out=}" ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT" || exit 2
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false
export DYNABATCH_BENCH_ASSETS="${DYNABATCH_BENCH_ASSETS:-repo}"

GPU_TEST_FILES="$(grep -rlE --include='*.py' 'mark\.gpu\b' tests | sort | tr '\n' ' ')"

# name | time limit in seconds | command
STEPS=(
    "install|90|$PY -m pip install --no-deps --no-build-isolation -e ."
    "preflight|60|$PY -c \"import torch, dynabatch; assert torch.cuda.is_available(), 'no CUDA device'; print(dynabatch.__file__, torch.cuda.get_device_name())\""
    "gpu-tests|100|$PY -m pytest -q -m gpu $GPU_TEST_FILES"
    "inference|150|$PY benchmarks/inference.py --device cuda --threads 4 --output $OUT_DIR/inference.md"
    "memory-model|130|$PY benchmarks/memory_model.py --device cuda --threads 4 --output $OUT_DIR/memory_model.md"
    "train-step|90|$PY benchmarks/train_step.py --device cuda --output $OUT_DIR/train_step.md"
    "overlap|100|$PY benchmarks/overlap.py --device cuda --threads 4 --n-texts 20000 --output $OUT_DIR/overlap.md"
)
HARDWARE_PROBES=(
    "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"
    "$PY -c \"import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, ' + (torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'))\""
)

if [ "$DRY_RUN" = 1 ]; then
    echo "gpu.sh --dry-run: nothing is run. In $ROOT, with HF_HUB_OFFLINE=1 DYNABATCH_BENCH_ASSETS=$DYNABATCH_BENCH_ASSETS:"
    echo "hardware: ${HARDWARE_PROBES[0]}"
    echo "hardware: ${HARDWARE_PROBES[1]}"
    for step in "${STEPS[@]}"; do
        IFS='|' read -r name limit command <<<"$step"
        if [ "$name" = install ] && [ "$INSTALL" = 0 ]; then
            echo "skip  $name (--no-install)"
            continue
        fi
        printf 'run   %-13s (at most %4ss): %s\n' "$name" "$limit" "$command"
    done
    echo "then: one table of the hardware and every check; outputs in $OUT_DIR/"
    exit 0
fi

mkdir -p "$OUT_DIR"
hardware="$(eval "${HARDWARE_PROBES[0]}" 2>/dev/null | head -n 1)"
hardware="${hardware:-no nvidia-smi}"
rows=()
failed=0
for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    if [ "$name" = install ] && [ "$INSTALL" = 0 ]; then
        rows+=("| $name | skipped (--no-install) | 0 | |")
        continue
    fi
    if [ "$name" = gpu-tests ] && [ -z "$GPU_TEST_FILES" ]; then
        rows+=("| $name | no test marked gpu | 0 | |")
        continue
    fi
    log="$OUT_DIR/$name.log"
    echo "== $name: $command" >&2
    start=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c "$command" >"$log" 2>&1
    rc=$?
    seconds=$(( $(date +%s) - start ))
    case "$rc" in
        0) status=ok ;;
        124|137) status="TIMEOUT after ${limit} s"; failed=1 ;;
        *) status="FAILED (exit $rc)"; failed=1 ;;
    esac
    if [ "$name" = gpu-tests ]; then
        summary="$(grep -E '[0-9]+ (passed|failed|error)' "$log" | tail -n 1)"
    else
        summary="$(tail -n 1 "$log")"
    fi
    rows+=("| $name | $status | $seconds | ${summary//|//} |")
    if [ "$name" = preflight ] && [ "$rc" != 0 ]; then
        echo "gpu.sh: the preflight failed (see $log); the checks after it need dynabatch and a CUDA device" >&2
        break
    fi
done
torch_line="$(eval "${HARDWARE_PROBES[1]}" 2>/dev/null | tail -n 1)"

{
    echo "## dynabatch GPU checks"
    echo
    echo "Hardware: $hardware; ${torch_line:-torch not importable}; $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "| check | status | seconds | last line of its output |"
    echo "|---|---|---:|---|"
    printf '%s\n' "${rows[@]}"
} | tee "$OUT_DIR/summary.md"
for table in inference memory_model train_step overlap; do
    if [ -f "$OUT_DIR/$table.md" ]; then
        echo
        cat "$OUT_DIR/$table.md"
    fi
done
exit "$failed"
