"""The HTTP layer: request parsing, engine calls and response formatting for `ember serve`.

openai.py and llamacpp.py hold the routes; generation.py sits between routes and engine;
prompts.py, tools.py and grammars.py turn request fields into prompt ids and grammars
(tokenfloor.py bounds a prompt's length before tokenizing it); replies.py (with jsonscan.py)
reads generated text back into content and tool calls; sse.py streams events and notices
disconnects; metrics.py exposes Prometheus metrics; guard.py checks Host and Origin (with the
rules of origins.py), API keys and body sizes, and answers CORS; connection.py puts deadlines
on slow clients; fields.py reads request bodies; state.py holds the settings, the loaded (or
sleeping) model and the requests in flight. ember/app.py assembles the app.
"""
