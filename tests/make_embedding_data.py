"""Writes tests/data/embeddings/*.npz: llama-server's embeddings (--embeddings, each pooling) and
rerank scores (--reranking) of the synthetic files of tests/encoders.py, for test_embeddings.py.

    LLAMA_CPP_DIR=../shared/llama.cpp python tests/make_embedding_data.py
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "bench"))
import peer  # noqa: E402
from encoders import write_bert, write_qwen3_reranker  # noqa: E402

OUT = HERE / "data" / "embeddings"
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France!", "hello world",
         "Rain today, sun tomorrow? The river is blue and the sky is large.", "Écrire du code: python, rust; données."]
QUERY = "What is the capital of France?"
# WordPiece edge cases: accents, CJK, emoji, control characters, unknown words, specials, spacing
TRICKY = ["naïve café, RÉSUMÉ", "東京 is a city 北京", "emoji 😀 here", "tab\tnew\nline\r\x00end", "xyzzyq qqq",
          "[CLS] inside [SEP] text [MASK]", "  leading and   spaced  ", "a.b,c!d?e", "under_score and-dash",
          "ﬁ ligature Ⅻ", "ALLCAPS Words", "", "12345 67.89", "don't stop", "ß straße"]
PORT = 8431
# (stored name, file, llama-server's pooling)
CASES = [("bert-cls", "bert", "cls"), ("bert-mean", "bert", "mean"), ("bert-none", "bert", "none"),
         ("bert-rank", "bert-rank", "rank"), ("qwen3-mean", "qwen3-rank", "mean"),
         ("qwen3-last", "qwen3-rank", "last"), ("qwen3-rank", "qwen3-rank", "rank"),
         ("smollm2-mean", "smollm2", "mean"), ("nomic-mean", "nomic-bert", "mean")]


def files(tmp: Path) -> dict[str, Path]:
    from ember import hub

    return {"smollm2": hub.resolve("smollm2"), "bert": write_bert(tmp / "bert.gguf"), "bert-rank": write_bert(tmp / "bert-rank.gguf", reranker=True),
            "nomic-bert": write_bert(tmp / "nomic-bert.gguf", nomic=True),
            "qwen3-rank": write_qwen3_reranker(tmp / "qwen3-rank.gguf")}


def serve(model: Path, pooling: str):
    import httpx

    flag = ["--reranking"] if pooling == "rank" else ["--embeddings", "--pooling", pooling]
    proc = peer.popen("llama-server", ["-m", str(model), "--port", str(PORT), "-t", "2", "-c", "1024", "-ub", "1024",
                                       "-b", "1024", "-np", "1", *flag])
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("llama-server did not start")


def case(model: Path, pooling: str) -> dict:
    import httpx

    proc = serve(model, pooling)
    url = f"http://127.0.0.1:{PORT}"
    try:
        if pooling == "rank":
            r = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": TEXTS}, timeout=60).json()
            scores = np.zeros(len(TEXTS), np.float32)
            for res in r["results"]:
                scores[res["index"]] = res["relevance_score"]
            return {"scores": scores}
        tokens = [httpx.post(url + "/tokenize", json={"content": t, "add_special": True, "parse_special": True}).json()["tokens"]
                  for t in TEXTS]
        r = httpx.post(url + "/embedding", json={"content": TEXTS, "embd_normalize": -1}, timeout=60).json()
        tricky = [httpx.post(url + "/tokenize", json={"content": t, "add_special": True, "parse_special": True}).json()
                  ["tokens"] for t in TRICKY]
        rows = [np.asarray(o["embedding"], np.float32) for o in sorted(r, key=lambda o: o["index"])]
        if pooling != "none":
            return {"vectors": np.stack([row[0] for row in rows]), "tokens": json.dumps(tokens),
                    "tricky": json.dumps(TRICKY), "tricky_tokens": json.dumps(tricky)}
        return {"vectors": np.concatenate(rows), "lengths": np.array([len(row) for row in rows], np.int32)}
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = files(Path(tmp))
        for name, file, pooling in CASES:
            data = case(paths[file], pooling)
            np.savez_compressed(OUT / f"{name}.npz", texts=json.dumps(TEXTS), query=QUERY, **data)
            print(name, {k: np.shape(v) for k, v in data.items()})


if __name__ == "__main__":
    main()
