"""Bodies of the embedding and rerank routes -> typed requests (400 naming the field)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import invalid
from ..fields import Fields, _is_integer

MAX_INPUTS = 2048  # inputs one request may hold (OpenAI's limit)


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    inputs: list  # each a str or a list of token ids
    param: str  # the field they came from ("input" or "content")
    openai: bool  # OpenAI's reply shape (else llama-server's)
    base64: bool = False
    dimensions: int | None = None
    normalize: int | None = None  # llama-server's embd_normalize (None: the server's)
    model: str | None = None


@dataclass(frozen=True, slots=True)
class RerankRequest:
    query: str
    documents: list[str]
    top_n: int
    tei: bool  # TEI's shape (a plain list, "score", return_text) rather than Jina's
    return_text: bool = False
    return_documents: bool = False
    model: str | None = None


def parse_embedding(body: Fields, openai: bool) -> EmbeddingRequest:
    """OpenAI's `input` (a string, strings, token ids or lists of ids), or llama-server's `content`
    (which also asks for llama-server's reply shape)."""
    param = "input" if body.has("input") else "content" if body.has("content") else None
    if param is None:
        raise invalid("input", '"input" (or "content") must be provided: a string, an array of strings, '
                               "an array of token ids or an array of such arrays", "missing_field")
    openai = openai and param == "input"
    fmt = body.choice("encoding_format", ("float", "base64"), "float")
    dims = body.int("dimensions", None, lo=1)
    norm = body.int("embd_normalize", None, lo=-1)
    return EmbeddingRequest(inputs_of(body.raw(param), param), param, openai, fmt == "base64", dims, norm,
                            body.str("model"))


def inputs_of(value, param: str) -> list:
    """The inputs, each a non-empty string or a non-empty list of ids; errors name the input
    (`input` for a single one, `input[i]` in an array of them)."""
    single = isinstance(value, str) or (isinstance(value, list) and value and all(_is_integer(v) for v in value))
    if not single and not isinstance(value, list):
        raise invalid(param, f"{param} must be a string, an array of strings, an array of token ids or an array "
                             "of such arrays", "invalid_type")
    items = [value] if single else value
    if not items:
        raise invalid(param, f"{param} must not be empty", "empty_input")
    if len(items) > MAX_INPUTS:
        raise invalid(param, f"{param} holds {len(items)} inputs; a request may hold at most {MAX_INPUTS}",
                      "too_many_inputs")
    return [_input(item, param if single else f"{param}[{i}]") for i, item in enumerate(items)]


def _input(item, name: str):
    if isinstance(item, str):
        if not item:
            raise invalid(name, f"{name} is an empty string; an input must hold some text", "empty_input")
        return item
    if isinstance(item, list) and all(_is_integer(v) for v in item):
        if not item:
            raise invalid(name, f"{name} is an empty array of token ids", "empty_input")
        return [int(v) for v in item]
    raise invalid(name, f"{name} must be a string or an array of token ids", "invalid_type")


def parse_rerank(body: Fields) -> RerankRequest:
    query = body.str("query")
    if query is None:
        raise invalid("query", '"query" must be provided (a string)', "missing_field")
    tei = body.has("texts") and not body.has("documents")
    key = "texts" if tei else "documents"
    docs = body.list(key)
    if not docs:
        raise invalid(key, f'"{key}" must be a non-empty array of strings', "missing_field" if docs is None else
                      "empty_input")
    if len(docs) > MAX_INPUTS:
        raise invalid(key, f"{key} holds {len(docs)} documents; a request may hold at most {MAX_INPUTS}",
                      "too_many_inputs")
    documents = [_document(d, f"{key}[{i}]") for i, d in enumerate(docs)]
    top_n = body.int("top_n", len(documents), lo=1)
    return RerankRequest(query, documents, min(top_n, len(documents)), tei, body.bool("return_text"),
                         body.bool("return_documents"), body.str("model"))


def _document(d, name: str) -> str:
    if isinstance(d, dict) and isinstance(d.get("text"), str):  # Cohere's {"text": ...}
        return d["text"]
    if not isinstance(d, str):
        raise invalid(name, f"{name} must be a string", "invalid_type")
    return d
