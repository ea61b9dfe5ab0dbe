#!/usr/bin/env bash
# The GPU check, run on a CUDA machine with MLX's CUDA backend installed: what MLX sees, the
# exactness suite's core on the GPU (ranks and the mlx-lm reference both on CUDA), a bench of
# cpchat next to mlx-lm there, and where one rank's prefill and decode spend their time. Logs go
# to $OUT (or ./device-out). Each step runs under its own limit.
set -uo pipefail
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

nvidia-smi -L
$PY - <<'EOF' 2>&1 | tee "$OUT/mlx.log"
import time
import mlx.core as mx
print("mlx", mx.__version__, "default device", mx.default_device(), "cuda", mx.cuda.is_available())
a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
mx.eval(a @ a)
t = time.perf_counter()
for _ in range(10):
    mx.eval(a @ a)
print(f"bf16 8192^3 matmul: {10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12:.0f} TFLOP/s")
EOF

timeout "${EXACT_S:-240}" $PY -m pytest -q -p no:cacheprovider --timeout 120 \
    tests/test_exactness.py tests/test_low_precision.py -k "short_prompts or two_thousand or checkpoint_forms" \
    2>&1 | tee "$OUT/exactness.log" | tail -25

timeout "${BENCH_S:-240}" $PY -m cpchat bench --hidden 2048 --layers 8 --form bfloat16 \
    --contexts "${CONTEXTS:-4096,16384}" --ranks 1,2 --decode 32 --repeats 1 --transport '' \
    --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -30

timeout "${PROFILE_S:-120}" $PY scripts/profile_decode.py --hidden 2048 --layers 8 --form bfloat16 \
    --context 16384 --decode 32 --top 15 > "$OUT/profile.log" 2>&1
head -4 "$OUT/profile.log"
