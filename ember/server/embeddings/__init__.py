"""Embeddings and reranking: OpenAI's /v1/embeddings, llama-server's /embedding(s) and the rerank
routes (/v1/rerank, /rerank, Jina's and Cohere's shape, TEI's with `texts`). request.py reads a
body into typed inputs, routes.py tokenizes them and runs them through the model's `Embedder`
(ember/engine/embed.py), reply.py writes the results in each API's shape."""
