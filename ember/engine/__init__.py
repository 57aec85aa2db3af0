"""Running models: the engine (continuous batching over a paged KV cache with a shared
prefix cache) and the LLM convenience API on top of it; embed.py: embeddings and rerank scores."""
from .embed import EmbedConfig, Embedder, Embeddings, EmbeddingError
from .engine import Engine, EngineClosed, EngineConfig, QueueFull
from .llm import LLM, Completion, ContextOverflow, GeneratedToken, Generation, Timings
from .requests import FinishEvent, GrammarSpec, ProgressEvent, PromptEvent, Request, RequestHandle, TokenEvent
from .scoring import PerplexityResult, TokenScores
from .speculate import DraftParams, SpecConfig

__all__ = ["LLM", "Completion", "ContextOverflow", "DraftParams", "EmbedConfig", "Embedder", "Embeddings",
           "EmbeddingError", "Engine", "EngineClosed", "EngineConfig", "FinishEvent", "GeneratedToken", "Generation",
           "GrammarSpec", "PerplexityResult", "ProgressEvent", "PromptEvent", "QueueFull", "Request", "RequestHandle",
           "SpecConfig", "Timings", "TokenEvent", "TokenScores"]
