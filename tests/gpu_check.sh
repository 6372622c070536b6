#!/usr/bin/env bash
# The CUDA backend's checks, for a machine with an NVIDIA GPU and a CUDA 12 driver (under 10 min).
#
# What it checks:
#   1. the backend starts on the GPU (cupy sees a device) and describes it;
#   2. tests/devices/test_cuda_sources.py: every CUDA C source in ember/ops/cuda compiles with NVRTC
#      for sm_80 and sm_90;
#   3. tests/devices/test_cuda_backend.py in `gpu` mode: all ONNX node-suite cases on backend "cuda"
#      against the suite's expected outputs (the CPU's known failures, tests/xfail_cpu.txt, as
#      xfails; plus tests/xfail_cuda.txt if present); a shared kernel meeting something cupy
#      lacks fails (no per-call CPU fallback exists); the key ops (Conv, MatMul,
#      Gemm, pools, softmax, norms, data movement...) placed on the device with no fallback;
#      the demo models (models/*.onnx) and any PyTorch exports in .cache/torch-models-*/
#      matching the CPU backend to 1e-4 relative.
#   4. benchmarks/bench_gpu.py: throughput of ResNet-50 at batch 64 and BERT-base at sequence
#      128, batch 32, against onnxruntime's CUDA provider where onnxruntime-gpu is installed
#      (each runtime in its own process, interleaved rounds; needs torch to export the models).
#   The node cases run in 8 parallel shards so cupy's first kernel compiles (cached on disk in
#   ~/.cupy/kernel_cache afterwards) use the CPU cores.
#
# Environment: a venv (.venv-gpu, or $EMBER_GPU_VENV) with ember installed editable with the
# cuda and test extras (cupy-cuda12x, pytest, onnxruntime, nvidia-cuda-nvrtc-cu12). Offline
# machines: if cupy/pytest/onnx are importable by python3 already, the venv reuses them
# (--system-site-packages) and installs ember alone; or set WHEELHOUSE=/path/to/wheels.
# Output: a summary per step; exit status 0 when everything passed.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
VENV=${EMBER_GPU_VENV:-.venv-gpu}
SHARDS=${EMBER_GPU_SHARDS:-8}
LOGS=${OUT:-/tmp}/ember-gpu-check
mkdir -p "$LOGS"

echo "== environment"
nvidia-smi -L || echo "nvidia-smi not available"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV" || exit 2
fi
. "$VENV/bin/activate"
PIP=(python -m pip install -q --disable-pip-version-check)
[ -n "${WHEELHOUSE:-}" ] && PIP+=(--no-index --find-links "$WHEELHOUSE")
if python -c "import cupy, pytest, onnx, numpy, ml_dtypes" 2>/dev/null; then
  "${PIP[@]}" --no-deps --no-build-isolation -e . || exit 2
  python -c "import nvidia.cuda_nvrtc" 2>/dev/null || "${PIP[@]}" nvidia-cuda-nvrtc-cu12 \
    || echo "(NVRTC wheel unavailable: the sources test will skip)"
else
  "${PIP[@]}" -e ".[cuda,test]" nvidia-cuda-nvrtc-cu12 || exit 2
fi
python - <<'EOF' || exit 3
from ember.runtime.backends import get_backend
import cupy
print(get_backend("cuda").describe(), "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "| driver", cupy.cuda.runtime.driverGetVersion())
EOF

echo "== generating the node cases (once)"
python -c "import sys; sys.path.insert(0, 'tests'); import onnx_suites; onnx_suites.node_cases_dir()" || exit 4

echo "== NVRTC sources + CUDA node suite in $SHARDS shards"
pids=()
timeout 120 python -m pytest -q -o addopts="" -p no:cacheprovider --import-mode=importlib \
  tests/devices/test_cuda_sources.py > "$LOGS/sources.log" 2>&1 &
pids+=($!)
for ((i = 0; i < SHARDS; i++)); do
  EMBER_TEST_SHARD="$i/$SHARDS" timeout 360 python -m pytest -q -o addopts="" \
    -p no:cacheprovider --import-mode=importlib -rfE --durations=5 \
    tests/devices/test_cuda_backend.py > "$LOGS/shard$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done

echo "== results"
for f in "$LOGS"/sources.log "$LOGS"/shard*.log; do
  echo "-- $(basename "$f"): $(tail -n 1 "$f")"
  grep -E "^(FAILED|ERROR)" "$f" | head -40
done
echo "== throughput (benchmarks/bench_gpu.py)"
timeout 200 python benchmarks/bench_gpu.py --rounds 3 --iters 10 2>&1 | tee "$LOGS/bench.log" \
  || echo "(benchmark failed or timed out; see $LOGS/bench.log)"

echo "elapsed $(( $(date +%s) - START )) s; logs in $LOGS"
[ $status -eq 0 ] && echo "ALL CUDA CHECKS PASSED" || echo "SOME CUDA CHECKS FAILED"
exit $status
