#!/usr/bin/env bash
# The cuda backend's checks and benchmarks on an NVIDIA GPU machine that has no network, in about 5 minutes (each
# step has a time limit, trimmed to what is left of BUDGET seconds, and a step that would start past it is skipped):
#   bash bench/gpu/fetch-wheels.sh               # here, with network: the wheels into .whl
#   OUT=/empty/folder bash bench/gpu/run.sh      # there, from the repository's root, with .whl beside it
# It installs the wheels into $SITE (never torch: the machine's own CUDA build runs), makes the repository
# importable without installing it, then runs the tests marked gpu and `bench moe --cuda` and `bench prefill --cuda`
# at Qwen3-30B-A3B's geometry at 512 and 4,096 tokens. A step that fails is logged and the next one runs.
# Into $OUT: run.log (machine, versions, each step's exit status and seconds), gpu-tests.log, bench.log (the
# tables), moe-512.json, moe-4096.json, prefill-512.json, prefill-4096.json (bench/results/ takes the JSON).
set -u
OUT=${OUT:?set OUT to the folder the results go to}
SITE=${SITE:-/tmp/site}
BUDGET=${BUDGET:-330}
REPO=$(pwd)
SHIM=/tmp/npumoe-shim
LOG="$OUT/run.log"
START=$(date +%s)
mkdir -p "$OUT"
[ -d "$REPO/engine/backends/cuda" ] || { echo "run from the repository's root" >&2; exit 2; }

say() { echo "$*" | tee -a "$LOG"; }

# step NAME LIMIT LOGFILE COMMAND...: runs COMMAND under `timeout`, appending its output to LOGFILE.
step() {
    local name=$1 limit=$2 log=$3 spent rc began
    shift 3
    spent=$(( $(date +%s) - START ))
    if (( spent + 20 > BUDGET )); then
        say "== $name: skipped, ${spent}s of the ${BUDGET}s budget gone"
        return
    fi
    (( limit > BUDGET - spent )) && limit=$(( BUDGET - spent ))
    say "== $name (at most ${limit}s): $*"
    echo "== $name: $*" >> "$log"
    began=$(date +%s)
    timeout -k 10 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    say "== $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)') after $(( $(date +%s) - began ))s"
}

say "npumoed gpu run, $(date -u +%FT%TZ), commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
{ nvidia-smi || echo "nvidia-smi: not found"; } >> "$LOG" 2>&1
say "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, $(free -g | awk '/Mem/ {print $2}') GiB"

step install 60 "$LOG" python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
    "$REPO"/.whl/*.whl
# The repository's folders under the import names pyproject.toml maps them to, with its version's metadata.
rm -rf "$SHIM" && mkdir -p "$SHIM/npumoe" "$SHIM/npumoed-0.1.0.dist-info"
for folder in engine jobs daemon bench launchd; do ln -s "$REPO/$folder" "$SHIM/npumoe/$folder"; done
printf 'Metadata-Version: 2.1\nName: npumoed\nVersion: 0.1.0\n' > "$SHIM/npumoed-0.1.0.dist-info/METADATA"
export PYTHONPATH="$SHIM:$SITE" NPUMOED_HOME=/tmp/npumoe-home NPUMOE_CACHE=/tmp/npumoe-cache
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
step versions 40 "$LOG" python3 -c "
import sys, torch, transformers
import npumoe.bench.gpu.rows
from npumoe.engine.backends.cuda.env import cuda_availability
print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__)
print('cuda backend:', cuda_availability())"

THREADS=$(nproc)
step gpu-tests 80 "$OUT/gpu-tests.log" python3 -m pytest -q -p no:randomly -p no:cacheprovider -n 0 -m gpu \
    --timeout 60 -rs tests/engine/test_cuda_gpu.py tests/bench/test_cuda_rows.py

BENCH=(python3 -m npumoe.daemon bench)
SHARED=(--cuda --geometry qwen3-30b-a3b --dtype bf16 --threads "$THREADS" --min-seconds 0)
for tokens in 512 4096; do
    step "moe-$tokens" 60 "$OUT/bench.log" "${BENCH[@]}" moe "${SHARED[@]}" --tokens "$tokens" --warmup 2 \
        --repeats 10 --json "$OUT/moe-$tokens.json"
done
# The whole-model prefill builds and calibrates its model on the CPU first (about a minute): the longer document,
# whose attention the GPU rows do not take, first.
for tokens in 4096 512; do
    step "prefill-$tokens" 150 "$OUT/bench.log" "${BENCH[@]}" prefill "${SHARED[@]}" --layers 2 \
        --document-tokens "$tokens" --chunk 512 --calibration-documents 1 --warmup 1 --repeats 3 \
        --json "$OUT/prefill-$tokens.json"
done
# NVML energy (the daemon's measure), in its own step: the daemon's tests need more of the project's packages.
step nvml-test 40 "$OUT/gpu-tests.log" python3 -m pytest -q -p no:randomly -p no:cacheprovider -n 0 -m gpu \
    --timeout 30 -rs tests/daemon/test_priority.py
say "done in $(( $(date +%s) - START ))s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
