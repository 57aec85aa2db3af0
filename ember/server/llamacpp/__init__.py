"""llama-server's API: routes.py (the handlers), request.py (bodies -> typed requests),
reply.py (runs -> llama-server's reply shapes)."""
