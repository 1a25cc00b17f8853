#!/usr/bin/env bash
# CI: the package as users get it. Builds the wheel and installs it in a clean virtual environment (no system site
# packages, nothing of the checkout on the path), then runs what the README runs with each install:
#   - the bare package: `import dynabatch` and the README's Python API (build_dynamic_batch_dataloader, run) on a
#     tokenizer and model made in memory (no extra installs a model);
#   - still bare: every module of the wheel imports, and each call that needs an extra (the demo's, Ray's, TRL's,
#     the plots) fails naming the extra to install; each command's --help runs, and each command line that needs an
#     extra refuses in one line naming it (.ci/extras_absent_check.py);
#   - then the `examples` extra added (the README's first command, docs/howto-embed-a-corpus.md): the README's corpus
#     job lines as written, read from README.md's "## The corpus job: one command" block, so this cannot drift.
# Any line that fails fails CI, naming the line.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
# torch 2.13.0 pinned as .ci/run pins it: a bare 'torch' requirement pulls a multi-GB CUDA build
pin=torch==2.13.0
start=$(date +%s)
say() { printf '\n== wheel check: %s (%ss)\n' "$*" "$(($(date +%s) - start))"; }

say "building the wheel"
# from a copy of the checkout's files (tracked, and untracked ones git does not ignore), so that it can run while the
# suite's editable install builds in the checkout's own build/
mkdir "$work/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard | (cd "$repo" && tar --null -T - -cf -) \
    | tar -C "$work/src" -xf -
python3 -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/torch_dynabatch-*.whl)

say "the bare package: a clean virtual environment holding $(basename "$wheel") and its dependencies alone"
python3 -m venv "$work/env"
# --no-compile: bytecode is written as modules are imported (compiling all of torch's costs minutes)
"$work/env/bin/pip" install -q --no-compile "$pin" "$wheel"
(cd "$work" && env -u PYTHONPATH "$work/env/bin/python" "$repo/.ci/bare_api_check.py")
# every module imports without an extra, and each call needing one names it (seconds: nothing more to install)
say "the bare package without an extra: every module imports, and each call that needs an extra names it"
(cd "$work" && env -u PYTHONPATH "$work/env/bin/python" "$repo/.ci/extras_absent_check.py")

# the extra on top of the bare install (one torch install, not two): what `pip install wheel[examples]` resolves to
say "the examples extra: the README's corpus job, line by line"
"$work/env/bin/pip" install -q --no-compile "$pin" "$wheel[examples]"
jobs=$(awk '/^## The corpus job: one command/ {s = 1} s && /^```bash/ {b = 1; next} b && /^```/ {exit} b' \
       "$repo/README.md")
[ -n "$jobs" ] || { echo "wheel check: README.md has no bash block under '## The corpus job: one command'" >&2; exit 1; }
mkdir "$work/job"
while IFS= read -r line; do
    [ -n "$line" ] || continue
    case "$line" in
        torchrun*) echo "-- skipped (the line above, one process a GPU: this machine has none; the suite's" \
                        "tests/cli/test_embed.py runs the command under torchrun): $line"; continue ;;
    esac
    echo "-- $line"
    if ! (cd "$work/job" && env -u PYTHONPATH PATH="$work/env/bin:$PATH" bash -euo pipefail -c "$line" < /dev/null); then
        echo "wheel check: this README line failed from the wheel with [examples]: $line" >&2
        exit 1
    fi
done <<< "$jobs"
# Exit status 0 also means "listed failed": every text and every chat has its row.
(cd "$work/job" && "$work/env/bin/python" - <<'EOF'
import pyarrow.dataset as ds

for store, rows in (("embeddings", 100), ("replies", 16)):
    held = ds.dataset(store, format="parquet").count_rows()
    assert held == rows, f"wheel check: {store}/ holds {held} rows, not {rows}"
EOF
)
say "done"
