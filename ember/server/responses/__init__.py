"""OpenAI's Responses API: POST /v1/responses, whole or streamed as typed events, with function
tools, structured output (text.format) and `previous_response_id` (conversations kept in memory,
store.py). request.py translates a body into OpenAI's chat shape and reads it with the chat
parser; reply.py writes the run back as a response with output items (reasoning, message,
function_call) or as the stream of response.* events."""
