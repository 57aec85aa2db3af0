"""The server's shared floor: a typed request (request.py) becomes token ids and a grammar
(prompts.py, tools.py), runs in the engine (run.py), and comes back as samples and reply deltas
(replies.py, jsonscan.py). No API's field names or reply shapes live here.
"""
