"""The HTTP layer: request parsing, engine calls and response formatting for `ember serve`.

openai.py and llamacpp.py hold the routes; generation.py sits between routes and engine;
prompts.py, tools.py and grammars.py turn request fields into prompt ids and grammars;
replies.py (with jsonscan.py) reads generated text back into content and tool calls;
sse.py streams events and notices disconnects; metrics.py exposes Prometheus metrics;
guard.py checks API keys and body sizes; fields.py reads request bodies; state.py holds the
settings and the loaded model. ember/app.py assembles the app.
"""
