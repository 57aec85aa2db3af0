"""The HTTP layer of `ember serve`, in three floors a request goes down and back up once.

    route (openai/routes.py, llamacpp/routes.py): parse -> run -> format, a few lines each
      api   openai/, llamacpp/: request.py reads a body into the API's typed request, once
            (fields.py: typed JSON reads naming the field in every 400); reply.py writes a run
            back in the API's shapes, whole or streamed (an exchange.Format)
      core  core/: the API's `Generation` (request.py: a Chat or Prompts, limits, sampling,
            stop, logprobs, an output Constraint) -> token ids and a grammar (prompts.py,
            tools.py) -> engine requests (run.py: `start` gives a `Run` of `Step`s, or its
            finished `Sample`s) -> reply deltas and tool calls (replies.py), named in no API's terms

An API is added as a package beside openai/ and llamacpp/: a parser from its body to a typed
request holding a core `Generation` (messages become `Message`s, tools a `ToolSetup`, response
schemas a `Constraint`), a `Format` that writes `Sample`s and `Step`s (text, tool-call start and
argument deltas) in its shapes, and its routes in ember/app.py. An Anthropic Messages or OpenAI
Responses route is that, with no change to core/.

Around the floors: exchange.py reads bodies off the event loop and writes replies or event
streams; sse.py streams events and notices disconnects; guard.py checks Host and Origin (with the
rules of origins.py), API keys and body sizes, and answers CORS; connection.py puts deadlines on
slow clients; metrics.py exposes Prometheus metrics; errors.py is the OpenAI-style error body;
state.py holds the settings, the loaded (or sleeping) model and the requests in flight
(tokenfloor.py bounds a prompt's length before it is tokenized). ember/app.py assembles the app.
"""
