# Set-up steps the device-run scripts share (sourced by bench/cuda_device_run.sh and
# bench/webgpu_device_run.sh; they set PY and SETUP first).

# install_wheels WHAT_IS_MISSING: the wheels carried in .devcarry/wheels into /tmp/ember_site, one at a
# time (a wheel that does not fit the machine's Python must not stop the others).
install_wheels() {
  local whl
  for whl in .devcarry/wheels/*.whl; do
    [ -f "$whl" ] || { echo "no .devcarry/wheels: $1"; break; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ember_site \
      "$whl" >>"$SETUP" 2>&1 || echo "wheel $(basename "$whl") did not install (see setup.log)"
  done
}

# unpack_skeletons: the real models' skeletons carried in .devcarry unpacked into /tmp/ember_models;
# MODELS gets NAME=PATH for each one that unpacked.
unpack_skeletons() {
  local m name
  mkdir -p /tmp/ember_models
  MODELS=()
  for m in smollm2 gemma3; do
    if [ -f ".devcarry/$m.skel" ] && $PY bench/gguf_skeleton.py unpack ".devcarry/$m.skel" "/tmp/ember_models/$m.gguf"; then
      name=$m; [ "$m" = gemma3 ] && name=gemma3-270m
      MODELS+=("$name=/tmp/ember_models/$m.gguf")
    else
      echo "skeleton $m missing or broken: its benchmarks are skipped"
    fi
  done
}

# build_cpu_ext: ember's CPU extension, as carried (ember/backends/cpu/_ember_cpu.abi3.so named in the
# call's carry: an abi3 build loads on the machine's Python) or else built here (minutes on the
# machine: its kernels are many translation units). Returns non-zero where neither worked.
build_cpu_ext() {
  if $PY -c 'import ember.backends.cpu' >>"$SETUP" 2>&1; then
    echo "CPU extension carried"
  elif timeout 420 $PY setup.py -q build_ext --inplace >>"$SETUP" 2>&1; then
    echo "CPU extension built"
  else
    return 1
  fi
}
