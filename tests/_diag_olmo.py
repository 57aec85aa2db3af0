import sys, time, numpy as np
sys.path.insert(0, "tests")
import families
from families import write_family, FAMILIES
from dataclasses import replace
from test_models import Runner
from ember.backends import get_backend
from ember.backends.cuda import CudaConfig
from ember.gguf_loader import GGUFFile
from ember.models import load_model
import cupy as cp

def probe(path, n_prompt, cfg):
    B = get_backend("cuda", config=cfg)
    first = []
    counter = [0]
    for name in ("matmul", "matmuls", "add", "rms_norm", "silu_mul", "attention", "rope", "kv_store", "scale", "add_bias", "embed"):
        if not hasattr(B, name): continue
        orig = getattr(B, name)
        def wrap(*a, _o=orig, _n=name, **k):
            r = _o(*a, **k); counter[0] += 1
            if not first:
                for i, x in enumerate(a):
                    xs = x if isinstance(x, list) else [x]
                    for y in xs:
                        d = getattr(y, "data", y)
                        if isinstance(d, cp.ndarray) and d.dtype.kind == "f" and not bool(cp.isfinite(d).all()):
                            first.append(f"op#{counter[0]} {_n} arg{i} shape {d.shape} absmax-finite {float(cp.nanmax(cp.abs(cp.where(cp.isfinite(d), d, 0))))}")
            return r
        setattr(B, name, wrap)
    with GGUFFile(path) as f:
        m = load_model(f, B)
        r = Runner(m, n_seq=1, max_len=n_prompt + 8, seed=0)
        rng = np.random.default_rng(0)
        out = r.step([list(rng.integers(0, m.n_vocab, n_prompt))])
        out2 = r.step([[1]])
    return np.isfinite(out).all(), np.isfinite(out2).all(), first[:1]

t = time.time()
p1 = write_family("/tmp/olmo2-real.gguf", "olmo2", real_shape=True)
FAMILIES["olmo2"] = replace(FAMILIES["olmo2"], meta={"rope.freq_base": 5e5})
p2 = write_family("/tmp/olmo2-nowin.gguf", "olmo2", real_shape=True)
print("written", time.time() - t, flush=True)
for p in (p1, p2):
    for n in (512, 64):
        for cfg in (CudaConfig(), CudaConfig(graphs=False, fuse=False)):
            try:
                print(p, n, cfg.graphs, probe(p, n, cfg), flush=True)
            except Exception as e:
                print(p, n, cfg.graphs, "ERR", repr(e)[:300], flush=True)
