#!/usr/bin/env bash
# What the GPU machine's runs carry, made on this machine (minutes; the machine reaches only package
# registries and Debian's mirrors): run once in a fresh checkout, from the repository's root, with
# ember installed (the real models are pulled if missing).
#
#   bash bench/device_prepare.sh [vk-build]
#
#   .gl/                    the Vulkan loader and its friends (the device README's list), for every run
#   .devcarry/wheels/       wgpu and the benchmark's packages for the machine's Python 3.12
#   .devcarry/*.skel        the two real models' skeletons (bench/gguf_skeleton.py)
#   .devcarry/llama-src.tar.xz      llama.cpp's tree for its CUDA build (bench/cuda_peer_device.sh)
#   .devcarry/llama-vk-src.tar.xz   ... for its Vulkan build, and .devcarry/vktools/: Debian sid's glslc
#                                   and friends (bench/webgpu_device_run.sh's vk_build)
#   vk-build                also build llama.cpp's Vulkan backend here into .devcarry/llama-vk-build.tar.xz
#                           (~10 minutes on 2 cores), so that the machine needs no build. Built without
#                           GGML_NATIVE (its CPU code must run on the other machine's processor); its
#                           64-stream figures for the small models came out far below a native build's, so
#                           building it on the machine (no vk-build here) is the default.
# The tree that travels (tracked files, .devcarry, .gl and the CPU extension) must stay under 64 MiB:
# carry either the CUDA tarball or the Vulkan ones, as the run needs, and move the other aside.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.gl/' .git/info/exclude 2>/dev/null || printf '/.gl/\n/.devcarry/\n/.lcb/\n' >>.git/info/exclude
mkdir -p .gl .devcarry/wheels .devcarry/vktools
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
mkdir -p /tmp/amd64/partial && apt-get $o update >/dev/null
(cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 2>/dev/null)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .devcarry/wheels wgpu==0.32.0 rendercanvas gguf cffi pycparser pyyaml tqdm
for m in smollm2:SmolLM2-135M-Instruct.Q4_1 gemma3-270m:gemma-3-270m-q4_k_m; do
  name=${m%%:*} file=~/.cache/ember/models/${m#*:}.gguf
  [ -f "$file" ] || ember pull "$name"
  python3 bench/gguf_skeleton.py pack "$file" ".devcarry/${name%-270m}.skel"
done
src=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$src"
tar xzf "$src"/llama_cpp_python-0.3.36.tar.gz -C "$src"
skip=()
for d in models docs media gguf-py tests examples pocs .git tools/server/webui; do skip+=(--exclude="llama.cpp/$d"); done
for b in cann hip metal musa opencl openvino sycl hexagon zdnn zendnn virtgpu et webgpu blas; do
  skip+=(--exclude="llama.cpp/ggml/src/ggml-$b")
done
vendor="$src/llama_cpp_python-0.3.36/vendor"
tar cJf .devcarry/llama-src.tar.xz -C "$vendor" "${skip[@]}" --exclude=llama.cpp/ggml/src/ggml-vulkan llama.cpp
tar cJf .devcarry/llama-vk-src.tar.xz -C "$vendor" "${skip[@]}" --exclude=llama.cpp/ggml/src/ggml-cuda llama.cpp
sid='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/sid/lists -oDir::Etc::SourceList=/tmp/sid/sources.list -oDir::Etc::SourceParts=/dev/null'
mkdir -p /tmp/sid/lists/partial
echo 'deb [trusted=yes] http://deb.debian.org/debian sid main' >/tmp/sid/sources.list
apt-get $sid update >/dev/null
(cd .devcarry/vktools && apt-get $sid download glslc libshaderc1 libvulkan-dev spirv-headers libc6 libstdc++6 libgcc-s1 2>/dev/null)
if [ "${1:-}" = vk-build ]; then
  b="$src/vk" root="$src/vk/root"
  mkdir -p "$root" && tar xJf .devcarry/llama-vk-src.tar.xz -C "$b"
  for deb in .devcarry/vktools/*.deb; do dpkg -x "$deb" "$root"; done
  mv "$root/usr/bin/glslc" "$root/usr/bin/glslc.real"
  printf '#!/bin/sh\nL=%s/usr/lib/x86_64-linux-gnu\nexec "$L/ld-linux-x86-64.so.2" --library-path "$L" %s/usr/bin/glslc.real "$@"\n' \
    "$root" "$root" >"$root/usr/bin/glslc" && chmod +x "$root/usr/bin/glslc"
  cmake -S "$b/llama.cpp" -B "$b/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DGGML_NATIVE=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DCMAKE_BUILD_RPATH='$ORIGIN' -DCMAKE_PREFIX_PATH="$root/usr" -DVulkan_INCLUDE_DIR="$root/usr/include" \
    -DVulkan_LIBRARY="$(ldconfig -p | awk '/libvulkan.so.1 .*x86-64/ {print $NF; exit}')" \
    -DVulkan_GLSLC_EXECUTABLE="$root/usr/bin/glslc" >/dev/null
  cmake --build "$b/build" --target llama-bench llama-batched-bench -j "$(nproc)" >/dev/null
  tar cJf .devcarry/llama-vk-build.tar.xz -C "$b/build" bin
fi
rm -rf "$src"
du -sh .devcarry .gl
