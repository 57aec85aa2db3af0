"""Embedding and rerank results in each API's reply shape."""
from __future__ import annotations

import base64

import numpy as np

from .request import EmbeddingRequest, RerankRequest


def embedding_reply(req: EmbeddingRequest, results: list, n_tokens: list[int], model_id: str):
    """OpenAI's list of embedding objects, or llama-server's list of {index, embedding: [rows]}."""
    if not req.openai:
        return [{"index": i, "embedding": (r if r.ndim == 2 else r[None, :]).tolist()} for i, r in enumerate(results)]
    data = [{"object": "embedding", "index": i, "embedding": _encoded(r, req.base64)} for i, r in enumerate(results)]
    total = sum(n_tokens)
    return {"object": "list", "data": data, "model": req.model or model_id,
            "usage": {"prompt_tokens": total, "total_tokens": total}}


def _encoded(v: np.ndarray, b64: bool):
    if b64:  # little-endian float32 bytes, as OpenAI's clients decode them
        return base64.b64encode(np.ascontiguousarray(v, "<f4").tobytes()).decode()
    return v.tolist()


def truncated(v: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` values, normalized again (a Matryoshka embedding's shorter form)."""
    if dimensions is None or dimensions >= len(v):
        return v
    head = v[:dimensions].astype(np.float64)
    norm = np.linalg.norm(head)
    return (head / norm if norm > 0 else head).astype(np.float32)


def rerank_reply(req: RerankRequest, scores: list[float], n_tokens: int, model_id: str):
    """The best top_n documents, best first: Jina's/Cohere's object, or TEI's plain list."""
    label = "score" if req.tei else "relevance_score"
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n]
    results = []
    for i in order:
        item = {"index": i, label: scores[i]}
        if req.tei and req.return_text:
            item["text"] = req.documents[i]
        if req.return_documents:
            item["document"] = {"text": req.documents[i]}
        results.append(item)
    if req.tei:
        return results
    return {"model": req.model or model_id, "object": "list", "results": results,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
