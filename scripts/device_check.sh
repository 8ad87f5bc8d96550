#!/usr/bin/env bash
# Everything a GPU machine should measure, in one short run (< 8 minutes on one GPU):
#   1. pytest -m gpu (the GPU-only tests),  2. the kernel benchmark,  3. the roofline benchmark.
# Every JSON lands in one folder (default: device_check_out/), with one log per step.
#
#   scripts/device_check.sh [OUT_DIR]                 # on an NVIDIA GPU machine
#   scripts/device_check.sh --cpu-smoke [OUT_DIR]     # the same steps on the CPU backend at small sizes
#
# A step that fails is reported and the next one still runs; the exit status is the number of failed steps.
set -u
mode=gpu
if [ "${1:-}" = "--cpu-smoke" ]; then mode=cpu; shift; fi
out="${1:-device_check_out}"
here="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$here" || exit 1
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"

if [ "$mode" = cpu ]; then
  export JAX_PLATFORMS=cpu
  tests=(python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels)   # collects the GPU tests; all skip on CPU
  kernels=(python3 scripts/bench_kernels.py --sizes 1024 --repeats 1 --json "$out/bench_kernels.json")
  roofline=(python3 scripts/bench_roofline.py --context 512 --compressors streaming,kivi4 --no-peers
            --json "$out/roofline.json")
else
  if ! python3 -c "import jax, sys; sys.exit(0 if any(d.platform == 'gpu' for d in jax.devices()) else 1)"; then
    echo "device_check: JAX sees no GPU (use --cpu-smoke to run the steps on the CPU)" >&2
    exit 2
  fi
  tests=(python3 -m pytest -q -m gpu -p no:cacheprovider)
  kernels=(python3 scripts/bench_kernels.py --json "$out/bench_kernels.json")
  roofline=(python3 scripts/bench_roofline.py --context 8192,32768 --compressors streaming,snapkv,kivi4,refresh_kivi4
            --json "$out/roofline.json")
fi

failed=0
run_step() {  # name, timeout seconds, command...
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  if timeout "$limit" "$@" > "$out/$name.log" 2>&1; then
    echo "device_check: $name ok ($((SECONDS - t0)) s)"
  else
    echo "device_check: $name FAILED (exit $?, $((SECONDS - t0)) s; see $out/$name.log)"
    failed=$((failed + 1))
  fi
}
run_step gpu_tests 150 "${tests[@]}"
run_step bench_kernels 120 "${kernels[@]}"
run_step bench_roofline 200 "${roofline[@]}"
echo "device_check: results in $out"
exit "$failed"
