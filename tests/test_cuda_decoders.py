"""The CUDA kernels' GGUF block decoders without a GPU: quant.cuh builds as host C++
(EMBER_HOST_TEST) with g++ (or nvcc), and bench/cuda_decode_check.py's program decodes random
blocks of every type the backend reads. Each decoded value must equal the numpy reference, and a
row times a vector done the way the decode kernels do it (x in int8, slice by slice) must match
float64 within int8 rounding."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from ember.quant import layout

pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("nvcc")), reason="needs g++ or nvcc")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "cuda_decode_check.py"
_spec = importlib.util.spec_from_file_location("cuda_decode_check", SCRIPT)
decode_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_check)


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("decoders")
    return decode_check.build(workdir), workdir


@pytest.mark.parametrize("qtype", decode_check.TYPES, ids=lambda t: t.name)
def test_block_decoders_match_numpy(exe, qtype):
    program, workdir = exe
    # 7 rows of 512 values, then 5 rows of an odd number of blocks: rows start at every alignment
    # the block sizes allow (Q8_0's 34 bytes: 2-byte offsets into the 16-byte loads)
    odd = 17 * max(32, layout(qtype).block_size)
    for rows, cols, seed in ((7, 512, 0), (5, odd, 1)):
        value_err, dot_err = decode_check.check(program, workdir, qtype, rows, cols, np.random.default_rng(seed))
        assert value_err < 1e-6, f"decoded values off by {value_err:.2e}"
        assert dot_err < (1e-5 if qtype in decode_check.TYPES[:3] else 2e-2), f"int8 dot off by {dot_err:.2e}"
