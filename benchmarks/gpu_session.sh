#!/usr/bin/env bash
# The GPU measurements, in parts that each fit one ten-minute command on a lent machine (one
# H100 or H200 whose python3 holds torch, Triton, transformers, peft, pytest-benchmark and
# pytest-xdist), run from the repository root there:
#
#   bash benchmarks/gpu_session.sh check           the GPU tests (Triton compiled for the device,
#                                                   the DP step on CUDA against float64), the
#                                                   kernel tests on CUDA, then `dpgrad
#                                                   autotune-report` on gpt2-small with an empty
#                                                   tune store (first-use tuning, timed)
#   bash benchmarks/gpu_session.sh step CASE...     bench_dp_step.py, full sizes, the cases named
#                                                   as in its test ids: hf-gpt2-64-128 hf-llama-1b-8-1024;
#                                                   PROVIDERS="non-private dpgrad-single" runs only
#                                                   those (the ratios need non-private), and
#                                                   DPGRAD_BENCH_REPEATS=2 two repeats instead of three
#   bash benchmarks/gpu_session.sh compare BASE CASE...
#                                                   the same cases (and PROVIDERS) at commit BASE
#                                                   (installed from `git archive`), then at the
#                                                   checkout, each with an empty tune store, on
#                                                   the same machine: results in $OUT/base and
#                                                   $OUT/head, and their step times and peak
#                                                   memory side by side
#                                                   (each part at most LIMIT seconds, default 270)
#   bash benchmarks/gpu_session.sh host             bench_host_overhead.py, full sizes: operations,
#                                                   host waits, CUDA's sync reports and kernel
#                                                   launches of a step, against the non-private step
#   bash benchmarks/gpu_session.sh graph            the captured DP step: its GPU tests
#                                                   (tests/test_gpu_graphs.py), then bench_dp_step
#                                                   for GPT-2 small B=64 T=128, WideResNet-16-4
#                                                   B=256 and ViT-B/16 B=32, the non-private step
#                                                   and dpgrad single, each eager and graphed
#                                                   (PROVIDERS="non-private-compile
#                                                   dpgrad-single-compile": under torch.compile)
#   bash benchmarks/gpu_session.sh kernels [-k EXPR]
#                                                   bench_kernels.py, full sizes (-k experts: the
#                                                   mixture-of-experts kernels alone, against their
#                                                   eager twins and cuBLAS per expert)
#   bash benchmarks/gpu_session.sh kernels-compare BASE
#                                                   the kernel table at commit BASE (dpgrad's own
#                                                   kernels only), then at the checkout (every
#                                                   provider, the roofline), T = 128 and 1024
#                                                   (GPT-2 small at B = 64, Llama-1B at B = 8), on
#                                                   the same machine in one call (at most 480 s):
#                                                   results in $OUT/base and $OUT/head, times side
#                                                   by side in $OUT/kernels-compare.log
#   bash benchmarks/gpu_session.sh profile [ARGS]   profile_dp_step.py (default: GPT-2 small B=64
#                                                   T=128 bf16, non-private, dpgrad single and
#                                                   per-block, the 30 costliest of each kind)
#   bash benchmarks/gpu_session.sh llama            where the Llama-1B shape's step (B=8 T=1024)
#                                                   spends its time: `dpgrad autotune-report --full`
#                                                   (every candidate's time per layer shape) and
#                                                   its profile, non-private and dpgrad single
#
# What each part writes goes to $OUT (./gpu-out where OUT is unset): its log and its results
# files. The parts of bench_dp_step run in several calls are one file again with
# `python benchmarks/merge_results.py`. Opacus is not on that machine: put its wheel in .whl/
# here (`pip download --no-deps opacus==1.6.0 -d .whl`, .whl/ ignored through
# .git/info/exclude) and carry .whl; without it Opacus's providers record why they did not run.
set -u -o pipefail
part=${1:-}
case $part in
    check | step | compare | host | graph | kernels | kernels-compare | profile | llama) shift ;;
    *) echo "usage: bash benchmarks/gpu_session.sh check | step CASE... | compare BASE CASE... | host" \
            "| graph | kernels | kernels-compare BASE | profile [ARGS] | llama" >&2
       exit 2 ;;
esac
[ "$part" != step ] || [ $# -gt 0 ] || { echo "step: name the cases, e.g. hf-gpt2-64-128" >&2; exit 2; }
[ "$part" != compare ] || [ $# -gt 1 ] || { echo "compare: name a commit and the cases, e.g. f66cec7 hf-llama-1b-8-1024" >&2; exit 2; }
[ "$part" != kernels-compare ] || [ $# -eq 1 ] || { echo "kernels-compare: name a commit, e.g. 8cfd8d3" >&2; exit 2; }
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=python3

# Installed for the entry point and subprocesses; from the repository root it imports without.
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || echo "gpu_session: pip could not install the checkout; running it from the repository root"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export DPGRAD_TUNE_DIR=${DPGRAD_TUNE_DIR:-$(mktemp -d)}
$PY -c "from dpgrad.tools import results; print(results.machine_info())" 2>&1 | tee -a "$OUT/$part.log"

# pytest over test modules on the machine's cores: a cold machine compiles every Triton config
# it tunes (minutes on one core). A CUDA error ends its worker (tests/conftest.py), which
# xdist replaces; SIGINT at the limit makes pytest print what failed so far, and the failures'
# tracebacks are in $OUT/<name>.log. Arguments: name, seconds, then pytest's.
tests() {
    local name=$1 limit=$2
    shift 2
    timeout -s INT "$limit" $PY -m pytest -v -p no:cacheprovider -n "$(($(nproc) - 2))" --max-worker-restart 100 \
        -rfE --tb=short "$@" >"$OUT/$name.log" 2>&1
    echo "$name: exit $?" | tee -a "$OUT/check.log"
    # -v: each result as it comes, so a test that ends its worker is named even when the limit
    # stops the run before its summary.
    grep -E "FAILED|ERROR|crashed|node down| passed| failed" "$OUT/$name.log" | grep -v INTERNALERROR | cut -c1-300 \
        | tail -40 | tee -a "$OUT/check.log"
}

# pytest over a benchmark suite at full size, its results into $OUT; at most 570 s (SIGINT at
# the limit: pytest ends the session and writes the results of the cases that ran).
bench() {
    DPGRAD_RESULTS_DIR=${RESULTS:-$OUT} timeout -s INT -k 20 "${LIMIT:-570}" $PY -m pytest -q -p no:cacheprovider --benchmark-enable \
        --benchmark-columns=median,rounds "$@" 2>&1 | tee -a "$OUT/$part.log"
}

# bench_dp_step's -k expression for the cases named, and the providers in PROVIDERS if set.
step_expr() {
    local expr="" only="" c p
    for c in "$@"; do expr="${expr:+$expr or }[$c-"; done
    if [ -n "${PROVIDERS:-}" ]; then
        for p in $PROVIDERS; do only="${only:+$only or }$p]"; done
        expr="($expr) and ($only)"
    fi
    echo "$expr"
}

case $part in
    check)
        tests gpu-tests 240 -m gpu tests
        # The kernel tests on CUDA tensors (their odd shapes and every dtype), every launch on
        # the Triton kernels. (The model tests build CPU models: they are the CPU passes'.)
        DPGRAD_BACKEND=triton tests kernel-tests 200 tests/test_triton_kernels.py
        start=$(date +%s%N)
        timeout 120 $PY -m dpgrad autotune-report --json "$OUT/autotune-report.json" 2>&1 | tee -a "$OUT/check.log"
        echo "autotune-report (empty store): exit $?, $(( ($(date +%s%N) - start) / 1000000 )) ms" \
            | tee -a "$OUT/check.log"
        ;;
    step)
        bench benchmarks/bench_dp_step.py -k "$(step_expr "$@")"
        ;;
    host)
        bench benchmarks/bench_host_overhead.py
        ;;
    graph)
        tests graph-tests 150 tests/test_gpu_graphs.py
        export PROVIDERS=${PROVIDERS:-"non-private dpgrad-single non-private-graph dpgrad-single-graph"}
        DPGRAD_BENCH_REPEATS=${DPGRAD_BENCH_REPEATS:-2} LIMIT=${LIMIT:-400} \
            bench benchmarks/bench_dp_step.py -k "$(step_expr hf-gpt2-64-128 wrn-16-4-256 vit-b16-32)"
        ;;
    compare)
        base=$1
        shift
        expr=$(step_expr "$@")
        tree=$(mktemp -d)
        git archive "$base" | tar -x -C "$tree" || { echo "compare: no commit $base here" >&2; exit 1; }
        echo "compare: $base, then $(git describe --always --dirty)" | tee -a "$OUT/compare.log"
        $PY -m pip install -q --no-deps --no-build-isolation "$tree" >/dev/null 2>&1 \
            || { echo "compare: pip could not install $base" >&2; exit 1; }
        # From its benchmarks folder, so that `dpgrad` is the one just installed.
        commit=$(git rev-parse --short "$base")
        (cd "$tree/benchmarks" && export DPGRAD_COMMIT=$commit && RESULTS=$OUT/base LIMIT=${LIMIT:-270} \
            DPGRAD_TUNE_DIR=$(mktemp -d) bench bench_dp_step.py -k "$expr")
        $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
            || { echo "compare: pip could not install the checkout" >&2; exit 1; }
        RESULTS=$OUT/head LIMIT=${LIMIT:-270} DPGRAD_TUNE_DIR=$(mktemp -d) bench benchmarks/bench_dp_step.py -k "$expr"
        $PY - "$OUT/base" "$OUT/head" <<'PYEOF' 2>&1 | tee -a "$OUT/compare.log"
import sys
from pathlib import Path
from dpgrad.tools import results
seen = {}  # (case, metric) -> {side: p50}
for side, folder in zip(("base", "head"), sys.argv[1:]):
    for r in results.flat_records(results.load(sorted(Path(folder).glob("dp_step_*.json")))):
        if r["metric"]["name"] in ("step_time", "peak_memory"):
            s = r["shape"]
            key = (s["model"], s["batch"], s["seq_len"], r["provider"])
            seen.setdefault((key, r["metric"]["name"]), {})[side] = r["metric"]["p50"]
nan = float("nan")
print(f"{'case':42} {'base ms':>9} {'head ms':>9} {'head/base':>9} {'base GiB':>9} {'head GiB':>9}")
for key in sorted({key for key, _ in seen}):
    t, m = seen.get((key, "step_time"), {}), seen.get((key, "peak_memory"), {})
    b, h = t.get("base", nan), t.get("head", nan)
    mb, mh = (m.get(side, nan) / 2**30 for side in ("base", "head"))
    print(f"{'-'.join(map(str, key)):42} {b:9.2f} {h:9.2f} {h / b:9.3f} {mb:9.2f} {mh:9.2f}")
PYEOF
        ;;
    kernels)
        bench benchmarks/bench_kernels.py "$@"
        ;;
    kernels-compare)
        base=$1
        tree=$(mktemp -d)
        git archive "$base" | tar -x -C "$tree" || { echo "kernels-compare: no commit $base here" >&2; exit 1; }
        echo "kernels-compare: $base, then $(git describe --always --dirty)" | tee -a "$OUT/kernels-compare.log"
        export DPGRAD_BENCH_SEQ_LENS=128,1024
        $PY -m pip install -q --no-deps --no-build-isolation "$tree" >/dev/null 2>&1 \
            || { echo "kernels-compare: pip could not install $base" >&2; exit 1; }
        # The base's own Triton kernels at the head's 8192 tokens a call and T (benches before
        # 2026-11-27 took 4096 tokens and every T); the comparison pairs equal shapes.
        sed -i -e 's/^TOKENS_PER_CALL = 512 if QUICK else 4096$/TOKENS_PER_CALL = 512 if QUICK else 8192/' \
            -e 's/^SEQ_LENS = (32, 128) if QUICK else (128, 512, 1024, 4096)$/SEQ_LENS = (128, 1024)/' \
            "$tree/benchmarks/bench_kernels.py"
        (cd "$tree/benchmarks" && export DPGRAD_COMMIT=$(git rev-parse --short "$base") && RESULTS=$OUT/base \
            LIMIT=${LIMIT_BASE:-170} bench bench_kernels.py -k "dpgrad and not eager")
        $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
            || { echo "kernels-compare: pip could not install the checkout" >&2; exit 1; }
        RESULTS=$OUT/head LIMIT=${LIMIT_HEAD:-290} bench benchmarks/bench_kernels.py
        $PY benchmarks/compare_kernels.py "$OUT/base" "$OUT/head" 2>&1 | tee -a "$OUT/kernels-compare.log"
        ;;
    profile)
        [ $# -gt 0 ] || set -- --model hf-gpt2 --batch 64 --seq-len 128 --dtype bf16 \
            --provider non-private dpgrad-single dpgrad-single-per-block --top 30
        timeout 300 $PY benchmarks/profile_dp_step.py "$@" --json "$OUT/profile.json" 2>&1 | tee -a "$OUT/profile.log"
        ;;
    llama)
        timeout 200 $PY -m dpgrad autotune-report --model llama-1b --batch-size 8 --seq-len 1024 --device cuda \
            --full --json "$OUT/autotune-llama-1b.json" 2>&1 | tee -a "$OUT/llama.log"
        timeout 250 $PY benchmarks/profile_dp_step.py --model hf-llama-1b --batch 8 --seq-len 1024 --dtype bf16 \
            --provider non-private dpgrad-single --top 30 --json "$OUT/profile-llama-1b.json" 2>&1 | tee -a "$OUT/llama.log"
        ;;
esac
