#!/usr/bin/env bash
# Every CUDA check of dynabatch in one unattended command, on a GPU machine without network access.
#
#   bash benchmarks/gpu.sh --out "$OUT"      # install, then every check; about 7.5 minutes on one H200
#   bash benchmarks/gpu.sh --dry-run         # print what it would run, run nothing, exit 0 (works on any machine)
#   bash benchmarks/gpu.sh --rehearse --no-install --out /tmp/gpu   # every step on the CPU, tiny sizes
#
# What it runs, in order, each under its own time limit and all of them under one budget (--budget,
# default 540 s: a step gets at most what is left of it; a step with under 15 s left is skipped). Each
# step's time on an H200 is planned in the STEPS table below (the 2026-11-28 run, plus the warm-ups and
# rounds added since): about 480 s in all, each limit 1.3-2 times its step's plan. Every timed
# benchmark first warms each engine until a repeated call's time is stable (at most 20 s: a young process
# ran its first GPU work ten times slower on an H200) and times engines in rotated rounds:
#   install       pip install --no-deps --no-build-isolation -e .  (the machine has torch with CUDA,
#                 transformers, sentence-transformers, accelerate, pyarrow, numba, pytest, hypothesis, but
#                 none of the extras; a system Python's "externally managed" refusal is lifted for it); the
#                 repository is also on PYTHONPATH, so a failed install (no setuptools there, say) stops nothing
#   preflight     import dynabatch; a CUDA device is there (every later step needs both)
#   gpu-tests     the tests marked `gpu` (pytest -m gpu), only the files that hold some
#   inference     benchmarks/inference.py --device cuda   (encoder forward and greedy generate, every method)
#   generation    benchmarks/generation.py --device cuda  (dynabatch.generate, fixed batches, generate_batch:
#                 time and sequential forwards, on replies of every length and on a long tail)
#   embeddings    benchmarks/embeddings.py --device cuda
#                 (dynabatch.integrations.sentence_transformers.encode, model.encode)
#   encoder-curve benchmarks/encoder_curve.py --device cuda (throughput against batch tokens: MiniLM, BERT-base,
#                 a 0.5B decoder embedder; the knee sets dynabatch embed's --max-batch-tokens)
#   memory-model  benchmarks/memory_model.py --device cuda (calibrate, plans, measured peaks on the GPU)
#   train-step    benchmarks/train_step.py --device cuda   (packed training steps, packed = padded loss)
#   overlap       benchmarks/overlap.py --device cuda      (a real encoder: streamed and built ahead vs in turn)
#   training      benchmarks/training_throughput.py --device cuda (fixed, group_by_length, token and memory
#                 budgets, packing under one limit; calibrate vs probe at the limit)
# A step that fails does not stop the others (only a failed preflight does).
#
# What it leaves in the output folder, and nothing else (the device tool brings back at most 8 files):
#   summary.md    the hardware, a table of every step (status, seconds, last line), then each benchmark's
#                 own tables; rewritten after every step, so a run cut short still leaves one
#   logs.txt      every step's whole output, one after another, appended as it runs
# The summary is also printed at the end.
#
# Models are built from configs with random weights; the text and tokenizer are the copies that
# travel with the repository (benchmarks/assets/, DYNABATCH_BENCH_ASSETS=repo), so nothing is
# downloaded. Exit status: 0 when every step passed, 1 otherwise.
#
# Environment: PYTHON (default python3); OUT (the output folder when --out is not given).

set -u -o pipefail

usage() {
    sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$0"
    echo "Options: --dry-run, --no-install, --rehearse (on the CPU, tiny sizes), --budget SECONDS (default 540),"
    echo "         --out DIR (default: \$OUT, else ./gpu-results), -h/--help"
}

DRY_RUN=0
INSTALL=1
REHEARSE=0
BUDGET=540
OUT_DIR="${OUT:-gpu-results}"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --no-install) INSTALL=0 ;;
        --rehearse) REHEARSE=1 ;;
        --budget) shift; BUDGET="${1:?--budget needs a number of seconds}" ;;
        --budget=*) BUDGET="${1#--budget=}" ;;
        --out) shift; OUT_DIR="${1:?--out needs a folder}" ;;
        --out=*) OUT_DIR="${1#--out=}" ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done
case "$BUDGET" in
    ''|*[!0-9]*) echo "gpu.sh: --budget should be a whole number of seconds, but got --budget=$BUDGET" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT" || exit 2
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
export DYNABATCH_BENCH_ASSETS="${DYNABATCH_BENCH_ASSETS:-repo}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # dynabatch from this tree, installed or not
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dynabatch-gpu.XXXXXX")"  # each step's table and log; only OUT_DIR comes back
trap 'rm -rf "$WORK"' EXIT

GPU_TEST_FILES="$(grep -rlE --include='*.py' 'mark\.gpu\b' tests | sort | tr '\n' ' ')"
if [ "$REHEARSE" = 1 ]; then DEVICE=cpu; else DEVICE=cuda; fi
# sized ARGS_ON_THE_GPU ARGS_IN_A_REHEARSAL: a step's sizes, the GPU's or the rehearsal's (tiny, on the CPU)
sized() { if [ "$REHEARSE" = 1 ]; then printf '%s' "$2"; else printf '%s' "$1"; fi; }

# name | time limit in seconds | command. The plan on an H200 (seconds): install 5, preflight 5, gpu-tests 35,
# inference 55, generation 120, embeddings 35, encoder-curve 60, memory-model 35, train-step 25, overlap 30,
# training 75 (both tables; the probe table crashed there before capped took a bare "cuda"): 480 in all.
# A rehearsal runs the same steps on the CPU at tiny sizes. Add a step by adding a line.
STEPS=(
    "install|60|PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore $PY -m pip install --no-deps --no-build-isolation --no-input --disable-pip-version-check -e ."
    "preflight|40|$PY -c \"import torch, dynabatch; print(dynabatch.__file__, torch.__version__, torch.version.cuda); $(sized "assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" "print('rehearsal on the CPU')")\""
    "gpu-tests|60|$PY -m pytest -q -rfEs -p no:cacheprovider -o addopts=--import-mode=importlib -m gpu $GPU_TEST_FILES"
    "inference|80|$PY benchmarks/inference.py --device $DEVICE $(sized '--threads 4 --repeats 2' '--threads 1 --n-texts 24 --methods plain,sorted,dynabatch --repeats 2') --output $WORK/inference.md"
    "generation|160|$PY benchmarks/generation.py --device $DEVICE $(sized '--n-prompts 192 --check 8 --rounds 2' '--n-prompts 12 --max-words 40 --max-new-tokens 12 --hidden 64 --layers 2 --check 4 --threads 1 --rounds 2 --warmup-cap 1') --output $WORK/generation.md"
    "embeddings|60|$PY benchmarks/embeddings.py --device $DEVICE $(sized '--n 5000 --repeats 2' '--n 16 --repeats 2 --threads 1') --output $WORK/embeddings.md"
    "encoder-curve|90|$PY benchmarks/encoder_curve.py --device $DEVICE $(sized '' '--tiny --tokens 256,512 --calls 1 --threads 1') --output $WORK/encoder_curve.md"
    "memory-model|60|$PY benchmarks/memory_model.py --device $DEVICE $(sized '--threads 4 --workloads pegasus,mistral' '--workloads mistral --n-texts 40 --new-tokens 4 --max-length 64') --output $WORK/memory_model.md"
    "train-step|45|$PY benchmarks/train_step.py --device $DEVICE $(sized '' '--steps 3 --hidden 32 --layers 1 --capacity 128 --n-texts 200 --threads 1') --output $WORK/train_step.md"
    "overlap|60|$PY benchmarks/overlap.py --device $DEVICE $(sized '--threads 4 --n-texts 20000' '--n-texts 300') --output $WORK/overlap.md"
    "training|110|$PY benchmarks/training_throughput.py --device $DEVICE $(sized '--threads 4' '--n-texts 40 --eval-texts 16 --max-length 32 --hidden 32 --layers 1 --threads 1 --tables throughput,probe') --output $WORK/training_throughput.md"
)
HARDWARE_PROBES=(
    "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader"
    "$PY -c \"import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, ' + (torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'))\""
)

if [ "$DRY_RUN" = 1 ]; then
    echo "gpu.sh --dry-run: nothing is run. In $ROOT, with HF_HUB_OFFLINE=1 DYNABATCH_BENCH_ASSETS=$DYNABATCH_BENCH_ASSETS, a budget of $BUDGET s:"
    echo "hardware: ${HARDWARE_PROBES[0]}"
    echo "hardware: ${HARDWARE_PROBES[1]}"
    for step in "${STEPS[@]}"; do
        IFS='|' read -r name limit command <<<"$step"
        if [ "$name" = install ] && [ "$INSTALL" = 0 ]; then
            echo "skip  $name (--no-install)"
            continue
        fi
        printf 'run   %-13s (at most %4ss): %s\n' "$name" "$limit" "${command//$WORK/<work>}"
    done
    echo "then: $OUT_DIR/summary.md (every step and table) and $OUT_DIR/logs.txt (every step's output)"
    exit 0
fi

mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.md"
LOGS="$OUT_DIR/logs.txt"
: >"$LOGS"
hardware="$(timeout 20 bash -c "${HARDWARE_PROBES[0]}" 2>/dev/null | head -n 1)"
hardware="${hardware:-no nvidia-smi}"
torch_line="$(timeout 60 bash -c "${HARDWARE_PROBES[1]}" 2>/dev/null | tail -n 1)"
started=$(date +%s)
rows=()
failed=0

write_summary() {  # the hardware, one row per step so far, then every table written so far
    {
        echo "## dynabatch GPU checks"
        echo
        echo "Hardware: $hardware; ${torch_line:-torch not importable}; $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo "Command: bash benchmarks/gpu.sh$( [ "$INSTALL" = 0 ] && printf ' --no-install')$( [ "$REHEARSE" = 1 ] && printf ' --rehearse') --budget $BUDGET; $(( $(date +%s) - started )) s so far"
        echo
        echo "| check | status | seconds | last line of its output |"
        echo "|---|---|---:|---|"
        printf '%s\n' "${rows[@]}"
        for step in "${STEPS[@]}"; do
            IFS='|' read -r name _ command <<<"$step"
            table="$(grep -oE "$WORK/[a-z_]+\.md" <<<"$command")"
            if [ -n "$table" ] && [ -s "$table" ]; then
                echo
                if grep -q '^## ' "$table"; then sed -n '/^## /,$p' "$table"; else cat "$table"; fi  # sections only
            fi
        done
    } >"$SUMMARY"
}

for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit command <<<"$step"
    left=$(( BUDGET - ($(date +%s) - started) ))
    if [ "$name" = install ] && [ "$INSTALL" = 0 ]; then
        rows+=("| $name | skipped (--no-install) | 0 | |")
        continue
    fi
    if [ "$name" = gpu-tests ] && [ -z "$GPU_TEST_FILES" ]; then
        rows+=("| $name | no test marked gpu | 0 | |")
        continue
    fi
    if [ "$left" -lt 15 ]; then
        rows+=("| $name | SKIPPED (budget of $BUDGET s spent) | 0 | |")
        failed=1
        write_summary
        continue
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "== $name (at most $limit s): $command" >&2
    printf '\n===== %s (at most %s s): %s\n' "$name" "$limit" "$command" >>"$LOGS"
    offset=$(stat -c %s "$LOGS")
    start=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c "$command" >>"$LOGS" 2>&1
    rc=$?
    seconds=$(( $(date +%s) - start ))
    tail -c +$(( offset + 1 )) "$LOGS" >"$WORK/$name.log"
    case "$rc" in
        0) status=ok ;;
        124|137) status="TIMEOUT after ${limit} s"; failed=1 ;;
        *) status="FAILED (exit $rc)"; failed=1 ;;
    esac
    if [ "$name" = gpu-tests ]; then
        summary="$(grep -E '[0-9]+ (passed|failed|error|skipped)' "$WORK/$name.log" | tail -n 1)"
    else
        summary="$(grep -v '^[[:space:]]*$' "$WORK/$name.log" | tail -n 1)"
    fi
    summary="${summary//|//}"
    rows+=("| $name | $status | $seconds | ${summary:0:200} |")
    echo "   $name: $status in $seconds s" >&2
    write_summary
    if [ "$name" = preflight ] && [ "$rc" != 0 ]; then
        echo "gpu.sh: the preflight failed (see $LOGS); the checks after it need dynabatch and a CUDA device" >&2
        break
    fi
done

write_summary
cat "$SUMMARY"
exit "$failed"
