"""OpenAI's API: routes.py (the handlers), request.py (bodies -> typed requests, with body.py and
messages.py, which llama-server's bodies share), reply.py (runs -> OpenAI's reply shapes)."""
