"""Embedding and rerank results in each API's reply shape."""
from __future__ import annotations

import base64
import json

import numpy as np

from .request import EmbeddingRequest, RerankRequest


def embedding_json(req: EmbeddingRequest, results: list, n_tokens: list[int], model_id: str) -> bytes:
    """The JSON text of OpenAI's list of embedding objects, or of llama-server's list of {index,
    embedding: [rows]}. Values are written as float32 (9 significant digits, as many as float32
    needs to read back the same), the way the vectors are computed."""
    if not req.openai:
        items = [f'{{"index":{i},"embedding":{_rows(r)}}}' for i, r in enumerate(results)]
        return f"[{','.join(items)}]".encode()
    data = ",".join(f'{{"object":"embedding","index":{i},"embedding":{_encoded(r, req.base64)}}}'
                    for i, r in enumerate(results))
    total = sum(n_tokens)
    return (f'{{"object":"list","data":[{data}],"model":{json.dumps(req.model or model_id, ensure_ascii=False)},'
            f'"usage":{{"prompt_tokens":{total},"total_tokens":{total}}}}}').encode()


def _rows(r: np.ndarray) -> str:
    return f"[{','.join(floats_json(row) for row in (r if r.ndim == 2 else r[None, :]))}]"


def _encoded(v: np.ndarray, b64: bool) -> str:
    if b64:  # little-endian float32 bytes, as OpenAI's clients decode them
        return f'"{base64.b64encode(np.ascontiguousarray(v, "<f4").tobytes()).decode()}"'
    return floats_json(v)


def floats_json(v: np.ndarray) -> str:
    """A JSON array of float32 values: '%.9g' reads back as the same float32 (and costs half of
    json's 17-digit float64 form); NaN and infinities as Python's json writes them."""
    values = v.astype(np.float32, copy=False).tolist()
    if not np.isfinite(v).all():
        return json.dumps(values)
    return f"[{','.join(map(_FLOAT.__mod__, values))}]"


_FLOAT = "%.9g"


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
