"""Embeddings and rerank scores of the synthetic files of tests/encoders.py (a BERT encoder with a
WordPiece vocabulary, a nomic-bert encoder, a bert reranker, a Qwen3-style decoder reranker) against llama-server's,
stored in tests/data/embeddings (tests/make_embedding_data.py): tokens equal, every vector with a
cosine of at least 0.9999, scores within 1% of their spread. Then the CPU backend against the float64 reference,
and the embedder's batching and pooling rules."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import DATA
from encoders import write_bert, write_qwen3_reranker

from ember.engine import LLM
from ember.engine.embed import EmbedConfig, Embeddings, EmbeddingError, normalized
from ember.models import ModelError

MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("encoders")
    return {"bert": write_bert(out / "bert.gguf"), "bert-rank": write_bert(out / "bert-rank.gguf", reranker=True),
            "nomic-bert": write_bert(out / "nomic-bert.gguf", nomic=True),
            "qwen3-rank": write_qwen3_reranker(out / "qwen3-rank.gguf")}


def peer(name: str) -> dict:
    with np.load(DATA / "embeddings" / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("name,file,pooling", [("bert-cls", "bert", "cls"), ("bert-mean", "bert", "mean"),
                                               ("qwen3-mean", "qwen3-rank", "mean"),
                                               ("qwen3-last", "qwen3-rank", "last"),
                                               ("nomic-mean", "nomic-bert", "mean")])
def test_pooled_vectors_as_llama_cpp(files, name, file, pooling):
    data = peer(name)
    texts = json.loads(str(data["texts"]))
    with Embeddings(files[file], device="cpu", threads=2, pooling=pooling) as e:
        assert [e.tokenize(t) for t in texts] == json.loads(str(data["tokens"]))
        got = np.stack(e.embed(texts, normalize=-1))
    assert cosines(got, data["vectors"]).min() >= MIN_COSINE


def test_every_token_as_llama_cpp(files):
    data = peer("bert-none")
    with Embeddings(files["bert"], device="cpu", threads=2, pooling="none") as e:
        rows = e.embed(json.loads(str(data["texts"])))
    assert [len(r) for r in rows] == data["lengths"].tolist()
    assert cosines(np.concatenate(rows), data["vectors"]).min() >= MIN_COSINE


@pytest.mark.parametrize("name,file", [("bert-rank", "bert-rank"), ("qwen3-rank", "qwen3-rank")])
def test_rerank_scores_as_llama_cpp(files, name, file):
    data = peer(name)
    with Embeddings(files[file], device="cpu", threads=2) as e:
        assert e.embedder.pooling == "rank"  # from the file
        scores = e.rank(str(data["query"]), json.loads(str(data["texts"])))
    want = data["scores"]
    # within 1% of the scores' spread (a head of 128 weights of spread 1 magnifies the vectors' rounding)
    np.testing.assert_allclose(scores, want, atol=max(1e-3, 0.01 * float(np.ptp(want))))
    if name == "bert-rank":  # well apart: the order is llama.cpp's
        assert np.argsort(scores).tolist() == np.argsort(want).tolist()


def test_cpu_against_reference(files):
    texts = ["a small tree", "the blue river in the city, by night"]
    out = {}
    for device in ("cpu", "reference"):
        with Embeddings(files["bert"], device=device, threads=2, pooling="mean") as e:
            out[device] = np.stack(e.embed(texts))
    assert cosines(out["cpu"], out["reference"]).min() >= 0.99999


def test_batched_equals_one_at_a_time(files):
    """Several sequences in one step give what each gives alone (no attention across sequences)."""
    texts = ["the cat", "a dog sat on the mat", "rain", "blue sky and sea"] * 3
    with Embeddings(files["bert"], device="cpu", threads=2, pooling="mean", max_batch_tokens=64) as e:
        together = np.stack(e.embed(texts))
        steps = e.embedder.steps
        alone = np.stack([e.embed([t])[0] for t in texts])
    assert steps < len(texts)  # packed
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_close_gives_the_model_back_while_the_object_is_held(files):
    import weakref

    from ember.engine import EngineClosed

    e = Embeddings(files["bert"], device="cpu", threads=2)
    assert len(e.embed(["the cat"])[0])
    model = weakref.ref(e.model)
    e.close()
    assert model() is None and e.closed
    with pytest.raises(EngineClosed, match="closed"):
        e.embed(["the cat"])
    e.close()


def test_refusals(files):
    with Embeddings(files["bert"], device="cpu", threads=2) as e:
        with pytest.raises(EmbeddingError, match="empty"):
            e.embedder.embed([[]])
        with pytest.raises(EmbeddingError, match="context holds 128"):
            e.embedder.embed([[101] * 129])
        with pytest.raises(EmbeddingError, match="vocabulary"):
            e.embedder.embed([[10 ** 6]])
        with pytest.raises(EmbeddingError, match="rank pooling"):
            e.embedder.rank([[101, 102]])
    with pytest.raises(ValueError, match="pooling must be one of"):
        EmbedConfig(pooling="max")
    with pytest.raises(ModelError, match="'bert' is an encoder"):
        LLM(files["bert"], device="cpu", threads=2)


def test_normalizations():
    v = np.array([3.0, -4.0], np.float32)
    assert np.allclose(normalized(v, 2), [0.6, -0.8])
    assert np.allclose(normalized(v, 1), [3 / 7, -4 / 7])
    assert np.allclose(normalized(v, 0), v * 32760 / 4)
    assert np.allclose(normalized(v, -1), v)
    assert np.allclose(normalized(np.zeros(2, np.float32), 2), 0)


def test_embed_command(files, capsys):
    """`ember embed`: one JSON vector a line, equal to the API's; --query: one score a line."""
    from ember.cli import main

    assert main(["embed", str(files["bert"]), "the cat", "a blue sky", "-t", "2", "--pooling", "mean"]) == 0
    lines = capsys.readouterr().out.splitlines()
    with Embeddings(files["bert"], device="cpu", threads=2, pooling="mean") as e:
        want = e.embed(["the cat", "a blue sky"])
    np.testing.assert_allclose([json.loads(line) for line in lines], want, atol=1e-6)
    assert main(["embed", str(files["bert-rank"]), "--query", "capital of France", "Paris, France", "a cat"]) == 0
    assert len(capsys.readouterr().out.split()) == 2


def test_wordpiece_edge_cases_as_llama_cpp(files):
    """Accents, CJK, emoji, control characters, unknown words, special-token text, spacing, ligatures."""
    data = peer("bert-cls")
    with Embeddings(files["bert"], device="cpu", threads=2) as e:
        got = [e.tokenize(t) for t in json.loads(str(data["tricky"]))]
    assert got == json.loads(str(data["tricky_tokens"]))
