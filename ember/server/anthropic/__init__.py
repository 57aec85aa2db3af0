"""Anthropic's Messages API: /v1/messages (whole or streamed events) and /v1/messages/count_tokens.
request.py translates a body into OpenAI's chat shape and reads it with the OpenAI parser (one
reading of messages, tools and sampling for every API); reply.py writes the run back as a message
with content blocks (thinking, text, tool_use) or as Anthropic's stream of events."""
