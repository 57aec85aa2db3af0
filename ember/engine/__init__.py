"""Running models: the engine (continuous batching over a paged KV cache with a shared
prefix cache) and the LLM convenience API on top of it."""
from .engine import (Engine, EngineClosed, EngineConfig, FinishEvent, PromptEvent, QueueFull, Request,
                     RequestHandle, TokenEvent)
from .llm import LLM, Completion, ContextOverflow, GeneratedToken, Generation, Timings, TokenScores
from .perplexity import PerplexityResult

__all__ = ["LLM", "Completion", "ContextOverflow", "Engine", "EngineClosed", "EngineConfig", "FinishEvent",
           "GeneratedToken", "Generation", "PerplexityResult", "PromptEvent", "QueueFull", "Request",
           "RequestHandle", "Timings", "TokenEvent", "TokenScores"]
