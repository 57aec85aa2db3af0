#!/usr/bin/env bash
# The WebGPU backend on a GPU machine, in one call:
#
#   bash bench/webgpu_device_run.sh [tests] [bench]     (default: tests bench)
#
#   tests  pytest tests/test_webgpu.py and the engine's decode-ahead test (the real-model cases skip where the models are not in the
#          model cache: skeletons have the real shapes, not the real weights)
#   bench  bench/webgpu.py on the skeletons (pp512, tg128, 3 reps; ember's CPU backend beside it,
#          llama.cpp's CPU build where LLAMA_CPP_DIR has it)
#          (BENCH_ARGS="--attention-ab": also the other prompt-attention kernel, attn_tile on a GPU)
#   lanes  bench/webgpu.py --lanes: the decode kernel with 32, 64 and 128 lanes a workgroup
#
# Carry .gl (the Vulkan loader and its friends, as Debian packages: the device README says how) and
# .devcarry: smollm2.skel and gemma3.skel (`python bench/gguf_skeleton.py pack MODEL.gguf
# .devcarry/NAME.skel`) and wheels/ for the machine's Python (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .devcarry/wheels
# wgpu==0.32.0 rendercanvas gguf cffi pycparser pyyaml tqdm`), and ember/backends/cpu/_ember_cpu.abi3.so as
# built here (the engine tests and the benchmark compare with the CPU backend; building it on the
# machine takes minutes). Logs and JSON go to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ember_webgpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
STAGES=${*:-tests bench}
SETUP="$OUT/setup.log"

stage() { echo; echo "=== $1 ($(date +%H:%M:%S))"; }
. bench/device_setup.sh

stage setup
for f in .gl/*.deb; do [ -f "$f" ] && dpkg -x "$f" /; done
ldconfig
ldconfig -p | grep -q libvulkan || echo "no libvulkan: carry .gl (the device README says how)"
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES=$icd
install_wheels "wgpu is missing, the tests will skip"
export PYTHONPATH="$PWD:/tmp/ember_site${PYTHONPATH:+:$PYTHONPATH}"
# the WebGPU backend's encoding helper first (seconds), then the rest (the CPU kernels take longer)
timeout 60 $PY ember/backends/webgpu/_build.py >>"$SETUP" 2>&1 || echo "WebGPU encoding helper not built (see setup.log)"
build_cpu_ext || echo "CPU extension not built (see setup.log): the CPU comparisons fail"
$PY -m ember info --system 2>&1 | grep -v XDG_RUNTIME_DIR | tee -a "$SETUP"
unpack_skeletons

for s in $STAGES; do
  case $s in
    tests)
      stage tests
      timeout 300 $PY -m pytest -q -p no:cacheprovider -rfEs --durations=8 tests/test_webgpu.py \
        "tests/test_engine.py::test_ahead_steps_give_the_same_tokens" >"$OUT/tests.log" 2>&1
      echo "pytest exit $?"
      grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/tests.log" | head -25
      tail -n 12 "$OUT/tests.log"
      ;;
    bench)
      stage bench
      [ ${#MODELS[@]} -gt 0 ] || { echo "no models to bench"; continue; }
      timeout 500 $PY bench/webgpu.py --models "${MODELS[@]}" --n-prompt 512 --n-gen 128 --reps 3 ${BENCH_ARGS:-} \
        --out "$OUT/bench.json" >"$OUT/bench.log" 2>&1
      echo "bench exit $?"
      grep -v XDG_RUNTIME_DIR "$OUT/bench.log" | tail -n 45
      ;;
    lanes)
      stage lanes
      [ ${#MODELS[@]} -gt 0 ] || { echo "no models"; continue; }
      timeout 200 $PY bench/webgpu.py --models "${MODELS[@]}" --lanes --reps 7 --out "$OUT/lanes.json" \
        >"$OUT/lanes.log" 2>&1
      echo "lanes exit $?"
      grep -v XDG_RUNTIME_DIR "$OUT/lanes.log" | tail -n 25
      ;;
    *) echo "unknown stage '$s' (tests, bench, lanes)" ;;
  esac
done
