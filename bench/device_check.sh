#!/usr/bin/env bash
# The one-shot GPU check, run from the repository root on a lent device machine (no network there):
#   make device-wheels                      (here: the wheels the machine lacks, into .wheels/)
#   device run, carry [".wheels"], command: bash bench/device_check.sh [tests|bench]
# Installs what is missing from .wheels/, runs the CUDA tests with compiled kernels (no interpreter), then
# bench/device.py; everything lands in $OUT (tests.log, bench.jsonl, summary.json). Budget: under 8 minutes.
# DEVICE_CHECK_SMOKE=1 runs the same steps on a CPU, small (one kernel test, bench/device.py --smoke): the
# script's own test (tests/backend/test_cuda_path.py). One part alone (tests, or bench) fits a shorter call;
# DEVICE_BENCH_FIGURES picks bench/device.py's groups (--figures). The first H200 runs: tests ~5 min, bench ~5 min.
set -uo pipefail
part="${1:-all}"
case "$part" in all|tests|bench) ;; *) echo "usage: bench/device_check.sh [tests|bench]" >&2; exit 2 ;; esac
OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 SCRIPTORIUM_HOME="${SCRIPTORIUM_HOME:-/tmp/scriptorium-home}"
unset SCRIPTORIUM_TRITON
smoke=()
bench_args=()
[ -n "${DEVICE_BENCH_FIGURES:-}" ] && bench_args=(--figures "$DEVICE_BENCH_FIGURES")
if [ "${DEVICE_CHECK_SMOKE:-}" = 1 ]; then
    export TRITON_INTERPRET=1
    smoke=(-k store_kv)
    bench_args+=(--smoke)
else
    unset TRITON_INTERPRET
fi
start=$(date +%s)

missing=$("$PY" - <<'PYCODE'
import importlib.util
print(" ".join(name for name in ("gguf", "xgrammar", "jsonschema") if importlib.util.find_spec(name) is None))
PYCODE
)
if [ -n "$missing" ]; then
    [ -d .wheels ] || { echo "missing: $missing; run 'make device-wheels' here and carry .wheels" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --find-links .wheels $missing 2>&1 | tail -3
fi
{ nvidia-smi -L 2>/dev/null || echo "no GPU"; "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    | tee "$OUT/machine.txt"

# The kernels against their references (fp32, bf16, fp16), the CUDA path's engine tests, structured output.
tests_rc=0
if [ "$part" != bench ]; then
    timeout $([ "$part" = tests ] && echo 470 || echo 240) "$PY" -m pytest -q -p no:cacheprovider -rfE \
        --durations=20 "${smoke[@]}" tests/backend/test_triton_kernels.py tests/backend/test_quant_cuda.py \
        tests/backend/test_cuda_path.py tests/backend/test_structured_output.py > "$OUT/tests.log" 2>&1
    tests_rc=$?
    tail -40 "$OUT/tests.log"
fi

bench_rc=0
if [ "$part" != tests ]; then
    left=$((470 - ($(date +%s) - start)))
    timeout "$left" "$PY" bench/device.py "${bench_args[@]}" > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
    bench_rc=$?
    cat "$OUT/bench.jsonl"
    tail -5 "$OUT/bench.err"
fi

printf '{"tests_rc": %s, "bench_rc": %s, "seconds": %s}\n' "$tests_rc" "$bench_rc" "$(($(date +%s) - start))" \
    | tee "$OUT/summary.json"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
