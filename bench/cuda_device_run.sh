#!/usr/bin/env bash
# Everything the CUDA backend needs checked on the GPU machine, in one call:
#
#   bash bench/cuda_device_run.sh [tests] [experts] [spec] [rows] [blas] [quick] [full]  (default: tests quick)
#
#   tests  pytest tests/test_cuda.py tests/test_cuda_fuse.py, ops first, then models, then the
#          decoder families (tests/test_cuda_families.py), then the quantized KV cache
#          (tests/test_cuda_kv.py): four processes
#   experts  pytest tests/test_cuda_experts.py, then bench/expert_micro.py (the grouped expert
#          products alone at issue 28's MoE shapes, the old kernel beside them)
#   spec   bench/spec_steps.py --device cuda on the edit and free workloads (3 repetitions, drafts on
#          and off, in process): SmolLM2's real file (too large for one call's carry) joined from the
#          pieces of `split -n 3` carried as .sp1, .sp2 and .sp3, one or more a call, by calls of this
#          stage on the same warm machine; SPEC_REPS (default 3) and SPEC_ARGS (e.g. "--sweep 1,2,...,17
#          --profile": shapes recorded before the timed requests) go to bench/spec_steps.py
#   mv     bench/mv_micro.py: the decode products alone at 8B and 1B shapes over 1-8 rows (MV_ARGS passed on)
#   rows   bench/cuda_rows.py: decode steps of n sequences (synthetic 135M, Llama-3.2-1B and 8B shapes, Q4_K_M),
#          kernel choices by rows as CudaConfig variants (ROWS_ARGS passed on, e.g. "--variants blas_rows=64
#          blas_rows=16 --counts 16 32 64")
#   blas   bench/prompt_gemm.py: the 8B's matrices at 16-512 rows (the cuBLAS route and its parts beside
#          the backend without it), then the whole 8B shape (Q4_K, written there) with the variants in
#          BLAS_VARIANTS (default: blas split64 blas48: as it is, mm_split to 64 rows, the route from
#          48 rows)
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
# pytest_stage TITLE LOG SECONDS PYTEST-ARGS...: one pytest process, its log in $OUT/LOG.log, the
# failures and the summary printed.
pytest_stage() {
  local title=$1 log=$OUT/$2.log limit=$3
  shift 3
  stage "$title"
  timeout "$limit" $PY -m pytest -q -p no:cacheprovider --maxfail=25 -rfE --durations=5 "$@" >"$log" 2>&1
  echo "pytest exit $?"
  grep -E "^(FAILED|ERROR)" "$log" | head -25
  tail -n 8 "$log"
}
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
if ! build_cpu_ext; then
  echo "CPU extension not built (see setup.log): CPU comparisons fall back to the reference backend"
fi
unpack_skeletons
$PY -c 'import ember.backends.cuda as c; b = c.Backend(); print(b.describe())' 2>&1 | tail -3

for s in $STAGES; do
  case $s in
    tests)
      # Separate processes: a kernel fault in the op tests (a lost CUDA context) cannot hide the model,
      # replay and engine results.
      pytest_stage "tests: ops" tests_ops 420 -k "not model and not replay and not engine${TESTS_K:+ and ($TESTS_K)}" \
        tests/test_cuda.py tests/test_cuda_fuse.py
      pytest_stage "tests: models, replay, engine" tests_models 210 \
        -k "(model or replay or engine)${TESTS_K:+ and ($TESTS_K)}" tests/test_cuda.py
      pytest_stage "tests: decoder families" tests_families 200 ${TESTS_K:+-k "$TESTS_K"} tests/test_cuda_families.py
      pytest_stage "tests: quantized KV cache" tests_kv 180 ${TESTS_K:+-k "$TESTS_K"} tests/test_cuda_kv.py
      ;;
    experts)
      # The grouped expert products: their tests, then bench/expert_micro.py (old kernel beside the new ones)
      pytest_stage "tests: experts" tests_experts 300 ${TESTS_K:+-k "$TESTS_K"} tests/test_cuda_experts.py
      stage "bench experts"
      timeout 300 $PY bench/expert_micro.py --out "$OUT/expert_micro.json" >"$OUT/expert_micro.log" 2>&1
      echo "bench exit $?"
      tail -n 40 "$OUT/expert_micro.log" | cut -c1-300
      ;;
    mv)
      # The decode products alone over 1-8 rows (MV_ARGS passed on, e.g. "--variants mv_stage=0 ''")
      stage "bench mv"
      eval "timeout 500 $PY bench/mv_micro.py --out $OUT/mv_micro.json ${MV_ARGS:-}" >"$OUT/mv_micro.log" 2>&1
      echo "bench exit $?"
      tail -n 60 "$OUT/mv_micro.log" | cut -c1-300
      ;;
    spec)
      # The pieces carried by this call join those earlier calls left in /tmp (a warm machine keeps it,
      # not the ignored paths of the tree); with all three there, the run.
      stage "bench spec"
      mkdir -p /tmp/ember_sp
      for i in 1 2 3; do [ -f ".sp$i/part" ] && cp ".sp$i/part" "/tmp/ember_sp/$i"; done
      if [ -f /tmp/ember_sp/1 ] && [ -f /tmp/ember_sp/2 ] && [ -f /tmp/ember_sp/3 ]; then
        cat /tmp/ember_sp/1 /tmp/ember_sp/2 /tmp/ember_sp/3 >/tmp/ember_models/smollm2-real.gguf
        # In process (the machine's Python has no starlette/uvicorn for bench/spec.py's servers); CuPy is
        # imported before the script's directory (bench/, which holds cuda.py) goes first on the path.
        timeout 420 $PY -c 'import cupy, cuda.pathfinder, runpy, sys; sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")' bench/spec_steps.py --device cuda \
          --model /tmp/ember_models/smollm2-real.gguf --workloads edit,free --reps ${SPEC_REPS:-3} ${SPEC_ARGS:-} \
          >"$OUT/spec.log" 2>&1
        echo "bench exit $?"
        tail -n 30 "$OUT/spec.log" | cut -c1-300
      else
        echo "SmolLM2's pieces so far: $(ls /tmp/ember_sp | tr '\n' ' ')(all of 1 2 3 needed; spec skipped)"
      fi
      ;;
    rows)
      stage "bench rows"
      timeout 480 $PY bench/cuda_rows.py ${ROWS_ARGS:-} --out "$OUT/cuda_rows.json" >"$OUT/cuda_rows.log" 2>&1
      echo "bench exit $?"
      tail -n 30 "$OUT/cuda_rows.log" | cut -c1-300
      ;;
    blas)
      stage "bench blas"
      timeout 90 $PY bench/prompt_gemm.py --shapes q-q4k up-q4k down-q6k q-q8 --tokens 16 32 48 64 512 --reps 10 \
        --out "$OUT/prompt_gemm.json" >"$OUT/prompt_gemm.log" 2>&1
      echo "bench exit $?"
      tail -n 21 "$OUT/prompt_gemm.log" | cut -c1-300
      timeout 360 $PY bench/prompt_gemm.py --model llama8b-Q4_K --rounds 1 --many --variants ${BLAS_VARIANTS:-blas split64 blas48} \
        --out "$OUT/prompt_gemm_8b.json" >"$OUT/prompt_gemm_8b.log" 2>&1
      echo "bench exit $?"
      grep -v "^\s*$" "$OUT/prompt_gemm_8b.log" | tail -n 8 | cut -c1-300
      rm -f /tmp/ember_models/llama8b-Q4_K.gguf
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
    *) echo "unknown stage '$s' (tests, experts, spec, rows, blas, quick, full)" ;;
  esac
done
