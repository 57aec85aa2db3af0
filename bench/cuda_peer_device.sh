#!/usr/bin/env bash
# ember beside llama.cpp's CUDA build on the GPU machine (bench/cuda_peer.py), with the build made
# there from llama.cpp's sources:
#
#   bash bench/cuda_peer_device.sh build          llama-bench and llama-batched-bench into .lcb/build/bin
#                                                 (in the background when BUILD_BG=1; log in .lcb/build.log)
#   bash bench/cuda_peer_device.sh peer MODEL...  bench/cuda_peer.py on those models (waits for a
#                                                 background build first)
#   bash bench/cuda_peer_device.sh profile MODEL...  ember alone on those models (no llama.cpp build):
#                                                 pp512, tg128 and a decode step's launches each timed
#                                                 alone (bench/cuda_peer.py --profile)
#
# Carry .devcarry: llama-src.tar.xz (llama.cpp's tree from the llama-cpp-python 0.3.36 sdist's
# vendor/llama.cpp, without its models, docs, tests and other GPU backends: `tar cJf` of it, ~5 MB)
# and wheels/ (see bench/cuda_device_run.sh). .lcb is ignored by git, so a warm machine keeps the
# build between calls.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ember_peer_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
SETUP="$OUT/setup.log"
BIN=.lcb/build/bin
. bench/device_setup.sh

build() {
  if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-batched-bench" ]; then
    echo "llama.cpp build present"
    return 0
  fi
  local t0=$SECONDS
  mkdir -p .lcb && tar xJf .devcarry/llama-src.tar.xz -C .lcb || return 1
  cmake -S .lcb/llama.cpp -B .lcb/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DGGML_CUDA_NCCL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    >.lcb/cmake.log 2>&1 || { tail -20 .lcb/cmake.log; return 1; }
  cmake --build .lcb/build --target llama-bench llama-batched-bench -j "$(nproc)" >.lcb/ninja.log 2>&1 \
    || { grep -m5 -B2 -A8 "error" .lcb/ninja.log; return 1; }
  echo "llama.cpp built in $((SECONDS - t0)) s"
}

case "${1:-}" in
  build)
    if [ "${BUILD_BG:-0}" = 1 ]; then
      mkdir -p .lcb && rm -f .lcb/done
      BUILD_BG=0 setsid bash -c "bash bench/cuda_peer_device.sh build >.lcb/build.log 2>&1; touch .lcb/done" \
        </dev/null >/dev/null 2>&1 &
      echo "llama.cpp build started in the background (.lcb/build.log)"
    else
      build
    fi
    ;;
  peer | profile)
    mode=$1
    shift
    install_wheels "gguf (the file writers) may be missing"
    [ -d /tmp/ember_site ] && export PYTHONPATH=/tmp/ember_site
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if [ "$mode" = profile ]; then
      $PY bench/cuda_peer.py --models "$@" --skip many peer --reps 2 --profile ${PEER_ARGS:-} --out "$OUT/profile.json"
      exit $?
    fi
    if [ -d .lcb ] && [ ! -x "$BIN/llama-batched-bench" ]; then
      echo "waiting for the llama.cpp build"
      while [ ! -e .lcb/done ] && [ ! -x "$BIN/llama-batched-bench" ]; do sleep 5; done
      tail -5 .lcb/build.log
    fi
    [ -x "$BIN/llama-bench" ] || build
    $PY bench/cuda_peer.py --llama-bin "$BIN" --models "$@" ${PEER_ARGS:-} --out "$OUT/peer.json"
    ;;
  *) echo "usage: $0 build | peer MODEL... | profile MODEL..." ; exit 2 ;;
esac
