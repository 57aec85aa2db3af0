"""Running models: the embedding API."""
from .llm import LLM, Completion, ContextOverflow, GeneratedToken, Generation, Timings, TokenScores
from .perplexity import PerplexityResult

__all__ = ["LLM", "Completion", "ContextOverflow", "GeneratedToken", "Generation", "PerplexityResult",
           "Timings", "TokenScores"]
