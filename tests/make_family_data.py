"""Writes tests/data/families/<family>.npz: llama.cpp's log-probabilities on each synthetic family
model (tests/families.py), reduced to what the default suite needs. Needs llama.cpp's programs
(bench/peer.py finds them); run after changing tests/families.py:

    python tests/make_family_data.py [FAMILY ...]

Per family: llama-perplexity --kl-divergence-base on the first 2 chunks of 128 tokens of the GPL-3
text; of each scored position the base's TOP most likely ids and their log-probabilities, the
chunk tokens, and the positions where llama.cpp's distribution is far from the float64
reference backend's (`far`, KLD > FAR: there the reference, not llama.cpp, is the oracle); and
llama-server's 32 greedy tokens after the text's first PROMPT tokens with each step's top-2 margin.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "bench"))
import families  # noqa: E402
import peer  # noqa: E402

from ember.engine import LLM  # noqa: E402
from ember.engine.kld import open_base  # noqa: E402
from ember.engine.scoring import kl_divergence  # noqa: E402

CTX, CHUNKS, TOP = 128, 2, 64
PROMPT = 24  # tokens of the text the greedy continuation starts from
FAR = 0.5  # KLD (nats) between llama.cpp and the float64 reference beyond which a position is ill-conditioned
OUT = HERE / "data" / "families"
TEXT = HERE / "data" / "GPL-3.txt"


def base_logits(model: Path, out: Path) -> None:
    proc, _ = peer.run("llama-perplexity", ["-m", str(model), "-f", str(TEXT), "-c", str(CTX), "-b", str(CTX),
                                             "--chunks", str(CHUNKS), "-t", "2", "--kl-divergence-base", str(out)])
    if proc.returncode:
        raise SystemExit(f"llama-perplexity failed on {model}:\n{proc.stderr[-2000:]}")


def greedy(model: Path, prompt: list[int], n: int = 32) -> tuple[list[int], list[float]]:
    """llama-server's greedy continuation of `prompt` and each step's top-2 log-probability margin."""
    import json
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = peer.popen("llama-server", ["-m", str(model), "--port", str(port), "-t", "2", "-c", "512", "-np", "1"])
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 2, "cache_prompt": False,
                           "samplers": ["top_k"], "top_k": 1}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=300).read())
    finally:
        server.terminate()
        server.wait()
    steps = reply["completion_probabilities"]
    ids = [s["id"] for s in steps]
    margins = [s["top_logprobs"][0]["logprob"] - s["top_logprobs"][1]["logprob"] for s in steps]
    return ids, margins


def reduce(name: str, model: Path, kld: Path) -> dict:
    base = open_base(kld)
    logp = np.concatenate([base.log_probs(c) for c in range(base.n_chunk)])
    ids = np.argsort(-logp, axis=1, kind="stable")[:, :TOP].astype(np.int32)
    with LLM(model, device="reference", ctx=CTX) as llm:
        far = np.flatnonzero(np.asarray(kl_divergence(llm, base).kld) > FAR).astype(np.int32)
    return dict(tokens=base.tokens, n_ctx=np.int32(base.n_ctx), n_vocab=np.int32(base.n_vocab), ids=ids,
                logp=np.take_along_axis(logp, ids, axis=1).astype(np.float32), far=far)


def main() -> None:
    names = sys.argv[1:] or sorted(families.FAMILIES)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model, kld = Path(tmp) / f"{name}.gguf", Path(tmp) / f"{name}.kld"
            families.write_family(model, name)
            base_logits(model, kld)
            data = reduce(name, model, kld)
            data["greedy_prompt"] = data["tokens"][:PROMPT]
            ids, margins = greedy(model, data["greedy_prompt"].tolist())
            data["greedy_ids"], data["greedy_margin"] = np.array(ids, np.int32), np.array(margins, np.float32)
            np.savez_compressed(OUT / f"{name}.npz", **data)
            print(name, f"{len(data['ids'])} positions, far from the reference at {data['far'].tolist()}")
    subprocess.run(["du", "-sh", str(OUT)])


if __name__ == "__main__":
    main()
