#!/usr/bin/env bash
# The WebGPU backend on a GPU machine, in one call:
#
#   bash bench/webgpu_device_run.sh [tests] [vulkan] [big] [bench] [lanes]     (default: tests bench)
#
#   tests  pytest tests/test_webgpu.py (PYTEST_K: only the tests -k selects) and the engine's
#          decode-ahead test (the real-model cases skip where the models are not in the model
#          cache: skeletons have the real shapes, not the real weights)
#   bench  bench/webgpu.py on the skeletons (pp512, tg128, 3 reps; ember's CPU backend beside it,
#          llama.cpp's CPU build where LLAMA_CPP_DIR has it)
#          (BENCH_ARGS="--attention-ab": also the other prompt-attention kernel, attn_tile on a GPU)
#   lanes  bench/webgpu.py --lanes: the decode kernel with 32, 64 and 128 lanes a workgroup
#   big    also a synthetic Llama-3.1-8B shape in Q4_K (bench/cuda_peer.py's writer, ~10 s) for bench
#   vulkan llama.cpp's Vulkan build beside ember in bench (--llama-bin, and 64 streams x (512 + 128)
#          through the engine and llama-batched-bench): built here in the background from the start
#          (minutes: its shaders), bench waits for it
#
# Carry .gl (the Vulkan loader and its friends, as Debian packages: the device README says how) and
# .devcarry: smollm2.skel and gemma3.skel (`python bench/gguf_skeleton.py pack MODEL.gguf
# .devcarry/NAME.skel`) and wheels/ for the machine's Python (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .devcarry/wheels
# wgpu==0.32.0 rendercanvas gguf cffi pycparser pyyaml tqdm`), and ember/backends/cpu/_ember_cpu.abi3.so as
# built here (the engine tests and the benchmark compare with the CPU backend; building it on the
# machine takes minutes). For vulkan, a build made elsewhere as .devcarry/llama-vk-build.tar.xz (its
# bin/ folder: llama-bench, llama-batched-bench and their libraries, configured as vk_build does with
# -DCMAKE_BUILD_RPATH='$ORIGIN', so that they load each other and the machine's Vulkan loader), or
# else, to build it here, .devcarry/llama-vk-src.tar.xz (llama.cpp's tree from the
# llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, `tar cJf` without ggml-cuda) and .devcarry/vktools:
# Debian sid's glslc, libshaderc1, libvulkan-dev (the headers) and spirv-headers, and the libc6,
# libstdc++6 and libgcc-s1 that this glslc needs (`apt-get download` with a sid source list): the
# machine's own Debian has an older glslc, without the extensions llama.cpp's fastest shaders use
# (cooperative matrices 2, integer dot products). glslc runs with sid's loader and libraries through
# a wrapper; the build itself uses the machine's compiler, C library and Vulkan loader (.gl's).
# Logs and JSON go to $OUT.
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

VK=.lcb/vk
# vk_build: llama-bench and llama-batched-bench of llama.cpp's Vulkan backend into $VK/build/bin
vk_build() {
  local t0=$SECONDS root=$PWD/$VK/root deb
  [ -x "$VK/build/bin/llama-batched-bench" ] && { echo "llama.cpp Vulkan build present"; return 0; }
  if [ -f .devcarry/llama-vk-build.tar.xz ]; then  # made on another machine of the same Debian: its bin/
    mkdir -p "$VK/build" && tar xJf .devcarry/llama-vk-build.tar.xz -C "$VK/build" || return 1
    echo "llama.cpp Vulkan build carried"
    return 0
  fi
  mkdir -p "$root" && tar xJf .devcarry/llama-vk-src.tar.xz -C "$VK" || return 1
  for deb in .devcarry/vktools/*.deb; do dpkg -x "$deb" "$root" || return 1; done
  mv "$root/usr/bin/glslc" "$root/usr/bin/glslc.real"
  printf '#!/bin/sh\nL=%s/usr/lib/x86_64-linux-gnu\nexec "$L/ld-linux-x86-64.so.2" --library-path "$L" %s/usr/bin/glslc.real "$@"\n' \
    "$root" "$root" >"$root/usr/bin/glslc"
  chmod +x "$root/usr/bin/glslc"
  cmake -S "$VK/llama.cpp" -B "$VK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DGGML_NATIVE=ON \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_RPATH='$ORIGIN' -DCMAKE_PREFIX_PATH="$root/usr" -DVulkan_INCLUDE_DIR="$root/usr/include" \
    -DVulkan_LIBRARY="$(ldconfig -p | awk '/libvulkan.so.1 .*x86-64/ {print $NF; exit}')" -DVulkan_GLSLC_EXECUTABLE="$root/usr/bin/glslc" \
    >"$VK/cmake.log" 2>&1 || { tail -20 "$VK/cmake.log"; return 1; }
  grep -E "supported by glslc" "$VK/cmake.log"
  cmake --build "$VK/build" --target llama-bench llama-batched-bench -j "$(nproc)" >"$VK/ninja.log" 2>&1 \
    || { grep -m5 -B2 -A8 "error" "$VK/ninja.log"; return 1; }
  echo "llama.cpp Vulkan build made in $((SECONDS - t0)) s"
}

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
case " $STAGES " in *" vulkan "*)
  mkdir -p "$VK" && rm -f "$VK/done"
  (vk_build >"$VK/build.log" 2>&1; touch "$VK/done") &
  VK_STARTED=1
  echo "llama.cpp Vulkan build started in the background";;
esac
case " $STAGES " in *" big "*)
  stage big
  BIG=/tmp/ember_models/llama8b-Q4_K.gguf
  [ -f "$BIG" ] || $PY -c "import sys; sys.path.insert(0, 'bench'); import cuda_peer
from pathlib import Path; cuda_peer.write(Path('$BIG'), 'llama8b-Q4_K')" >>"$SETUP" 2>&1 || echo "the 8B file was not written"
  [ -f "$BIG" ] && MODELS=("llama8b=$BIG" "${MODELS[@]}");;
esac

for s in $STAGES; do
  case $s in
    tests)
      stage tests
      timeout 300 $PY -m pytest -q -p no:cacheprovider -rfEs --durations=8 ${PYTEST_K:+-k "$PYTEST_K"} tests/test_webgpu.py \
        "tests/test_engine.py::test_ahead_steps_give_the_same_tokens" >"$OUT/tests.log" 2>&1
      echo "pytest exit $?"
      grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/tests.log" | head -25
      tail -n 12 "$OUT/tests.log"
      ;;
    bench)
      stage bench
      [ ${#MODELS[@]} -gt 0 ] || { echo "no models to bench"; continue; }
      PEER=()
      if [ -n "${VK_STARTED:-}" ]; then
        echo "waiting for the llama.cpp Vulkan build"
        while [ ! -e "$VK/done" ]; do sleep 5; done
        cat "$VK/build.log"
        [ -x "$VK/build/bin/llama-bench" ] && PEER=(--llama-bin "$VK/build/bin" --many 64)
      fi
      timeout 500 $PY bench/webgpu.py --models "${MODELS[@]}" --n-prompt 512 --n-gen 128 --reps 3 "${PEER[@]}" ${BENCH_ARGS:-} \
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
    big | vulkan) ;;  # set up above
    *) echo "unknown stage '$s' (tests, bench, lanes, big, vulkan)" ;;
  esac
done
