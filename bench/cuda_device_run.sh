#!/usr/bin/env bash
# Everything the CUDA backend needs checked on the GPU machine, in one call:
#
#   bash bench/cuda_device_run.sh [tests] [experts] [spec] [quick] [full]     (default: tests quick)
#
#   tests  pytest tests/test_cuda.py tests/test_cuda_fuse.py, ops first, then models, then the
#          decoder families (tests/test_cuda_families.py), then the quantized KV cache
#          (tests/test_cuda_kv.py): four processes
#   experts  pytest tests/test_cuda_experts.py, then bench/expert_micro.py (the grouped expert
#          products alone at issue 28's MoE shapes, the old kernel beside them)
#   spec   bench/spec.py --device cuda --skip-peer on the edit workload (3 repetitions): SmolLM2's real
#          file (too large for one call's carry) joined from pieces carried as .sp1, .sp2 and .sp3 by
#          calls on the same warm machine (`split -n 3` of it)
#   quick  bench/cuda.py --quick on the two skeleton models (fewer reps, 32 generated in the
#          64-stream runs, the 1.5 B roofline in Q4_K only)
#   full   bench/cuda.py at full size (5 reps, 64 x (512 + 128), roofline Q4_K and Q8_0)
#   TESTS_K="expr" narrows both test stages to pytest -k expr; BENCH_SKIP="sections" is passed to
#   bench/cuda.py --skip (see its --help); BENCH_VARIANTS="a,b" to --variants.
#
# Carry .devcarry: smollm2.skel and gemma3.skel (skeletons of the real models, made here with
# `python bench/gguf_skeleton.py pack MODEL.gguf .devcarry/NAME.skel`: the call carries 64 MiB at
# most), wheels/ (gguf, cffi, pycparser, pyyaml, tqdm for the machine's Python: `pip download
# --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d
# .devcarry/wheels gguf cffi pycparser pyyaml tqdm`), and optionally kernels/ compiled ahead with
# bench/cuda_kernel_cache.py. The
# machine's python3 has CuPy, numpy, tokenizers and jinja2; ember runs from this checkout
# (PYTHONPATH), its CPU extension built in place when cffi and gcc allow (the CUDA backend needs
# none of it; without it the engine test compares with the reference backend).
# Logs and JSON go to $OUT; each stage reports its own failure and the next one still runs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ember_cuda_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
STAGES=${*:-tests quick}
SETUP="$OUT/setup.log"

stage() { echo; echo "=== $1 ($(date +%H:%M:%S))"; }
. bench/device_setup.sh

stage setup
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  $PY -c 'import sys, numpy, cupy; print(sys.version); print("numpy", numpy.__version__, "cupy", cupy.__version__,
"runtime", cupy.cuda.runtime.runtimeGetVersion(), "nvrtc", cupy.cuda.nvrtc.getVersion())' 2>&1
} | tee "$SETUP"
install_wheels "gguf (tests, roofline) and cffi (CPU extension) may be missing"
[ -d /tmp/ember_site ] && export PYTHONPATH=/tmp/ember_site
# Kernels compiled ahead here (bench/cuda_kernel_cache.py --arch 90 --out .devcarry/kernels): a fresh
# machine then compiles only what they miss (the cold-start section still uses an empty cache).
if [ -d .devcarry/kernels ]; then
  mkdir -p /tmp/ember_kernels && cp -n .devcarry/kernels/*.cubin /tmp/ember_kernels/ 2>/dev/null
  export EMBER_KERNEL_CACHE=/tmp/ember_kernels
  echo "kernel cache: $(ls /tmp/ember_kernels | wc -l) modules carried"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if timeout 120 $PY setup.py -q build_ext --inplace >>"$SETUP" 2>&1; then
  echo "CPU extension built"
else
  echo "CPU extension not built (see setup.log): CPU comparisons fall back to the reference backend"
fi
unpack_skeletons
$PY -c 'import ember.backends.cuda as c; b = c.Backend(); print(b.describe())' 2>&1 | tail -3

for s in $STAGES; do
  case $s in
    tests)
      # Two processes: a kernel fault in the op tests (a lost CUDA context) cannot hide the model,
      # replay and engine results.
      stage "tests: ops"
      timeout 240 $PY -m pytest -q -p no:cacheprovider --maxfail=25 -rfE --durations=5 \
        -k "not model and not replay and not engine${TESTS_K:+ and ($TESTS_K)}" \
        tests/test_cuda.py tests/test_cuda_fuse.py \
        >"$OUT/tests_ops.log" 2>&1
      echo "pytest exit $?"
      grep -E "^(FAILED|ERROR)" "$OUT/tests_ops.log" | head -25
      tail -n 8 "$OUT/tests_ops.log"
      stage "tests: models, replay, engine"
      timeout 210 $PY -m pytest -q -p no:cacheprovider --maxfail=25 -rfE --durations=5 \
        -k "(model or replay or engine)${TESTS_K:+ and ($TESTS_K)}" tests/test_cuda.py \
        >"$OUT/tests_models.log" 2>&1
      echo "pytest exit $?"
      grep -E "^(FAILED|ERROR)" "$OUT/tests_models.log" | head -25
      tail -n 8 "$OUT/tests_models.log"
      stage "tests: decoder families"
      timeout 200 $PY -m pytest -q -p no:cacheprovider --maxfail=25 -rfE --durations=5 \
        ${TESTS_K:+-k "$TESTS_K"} tests/test_cuda_families.py \
        >"$OUT/tests_families.log" 2>&1
      echo "pytest exit $?"
      grep -E "^(FAILED|ERROR)" "$OUT/tests_families.log" | head -25
      tail -n 8 "$OUT/tests_families.log"
      stage "tests: quantized KV cache"
      timeout 180 $PY -m pytest -q -p no:cacheprovider --maxfail=25 -rfE --durations=5 \
        ${TESTS_K:+-k "$TESTS_K"} tests/test_cuda_kv.py \
        >"$OUT/tests_kv.log" 2>&1
      echo "pytest exit $?"
      grep -E "^(FAILED|ERROR)" "$OUT/tests_kv.log" | head -25
      tail -n 8 "$OUT/tests_kv.log"
      ;;
    experts)
      # The grouped expert products: their tests, then bench/expert_micro.py (old kernel beside the new ones)
      stage "tests: experts"
      timeout 300 $PY -m pytest -q -p no:cacheprovider --maxfail=25 -rfE --durations=5 \
        ${TESTS_K:+-k "$TESTS_K"} tests/test_cuda_experts.py \
        >"$OUT/tests_experts.log" 2>&1
      echo "pytest exit $?"
      grep -E "^(FAILED|ERROR)" "$OUT/tests_experts.log" | head -25
      tail -n 8 "$OUT/tests_experts.log"
      stage "bench experts"
      timeout 300 $PY bench/expert_micro.py --out "$OUT/expert_micro.json" >"$OUT/expert_micro.log" 2>&1
      echo "bench exit $?"
      tail -n 40 "$OUT/expert_micro.log" | cut -c1-300
      ;;
    spec)
      stage "bench spec"
      if [ -f .sp1/part ] && [ -f .sp2/part ] && [ -f .sp3/part ]; then
        cat .sp1/part .sp2/part .sp3/part >/tmp/ember_models/smollm2-real.gguf
        timeout 420 $PY bench/spec.py --device cuda --model /tmp/ember_models/smollm2-real.gguf --skip-peer \
          --workloads edit --reps ${SPEC_REPS:-3} --out "$OUT/spec_cuda.json" >"$OUT/spec.log" 2>&1
        echo "bench exit $?"
        tail -n 30 "$OUT/spec.log" | cut -c1-300
      else
        echo "SmolLM2's pieces .sp1/part .sp2/part .sp3/part not all carried: spec skipped"
      fi
      ;;
    quick|full)
      stage "bench $s"
      flag=""; [ "$s" = quick ] && flag="--quick"
      limit=330; [ "$s" = full ] && limit=540
      timeout $limit $PY bench/cuda.py $flag ${BENCH_SKIP:+--skip $BENCH_SKIP} ${BENCH_VARIANTS:+--variants $BENCH_VARIANTS} --models ${MODELS[@]+"${MODELS[@]}"} --out "$OUT/bench_$s.json" \
        >"$OUT/bench_$s.log" 2>&1
      echo "bench exit $?"
      grep -E "FAILED|Error" "$OUT/bench_$s.log" | head -10
      if grep -q "^device copy bandwidth" "$OUT/bench_$s.log"; then
        sed -n '/^device copy bandwidth/,$p' "$OUT/bench_$s.log"
      else
        tail -n 30 "$OUT/bench_$s.log" | cut -c1-400
      fi
      ;;
    *) echo "unknown stage '$s' (tests, experts, spec, quick, full)" ;;
  esac
done
