"""`sharpi serve`: an OpenAI-compatible HTTP server over one Session (Starlette + uvicorn, the
`serve` extra), one module per concept, as the C++ core is split:

- prompt.py: what the Session is given: chat messages rendered with the model's template
  (render_chat, encode_chat; fit_tool_calls for earlier tool calls), fill-in-the-middle prompts
  (fim_token_ids, fim_prompt_ids), a lower bound on a text's tokens (max_token_bytes), and the
  prefix of a prompt the KV cache already holds (reuse_prefix); `sharpi chat` uses them too.
- scheduler.py: the Engine, which owns the Session, its slots (one sequence each, --parallel) and
  the one worker thread that steps them (continuous batching), and the Job each request queues on it.
- stops.py: stop strings found in streamed text, and the stream of a Job's pieces cut at the first.
- logprobs.py: log-probabilities of generated tokens in OpenAI's shapes.
- errors.py: ApiError, a refused request in OpenAI's error shape (Anthropic's on its paths).
- body.py: a request's JSON body, bounded by --max-body and parsed off the event loop.
- served.py: ServedModel, what every route needs: the Engine, names, template, defaults, limits.
- openai_api.py: the OpenAI protocol: request bodies parsed into Session options, and the
  /v1/chat/completions and /v1/completions handlers with their (streamed) responses.
- anthropic_api.py: Anthropic's Messages protocol (/v1/messages, /v1/messages/count_tokens),
  translated into the chat pipeline openai_api serves and its replies written back in
  Anthropic's shapes and events.
- agents.py: tools, tool_choice, response_format, grammar and reasoning: the ChatPlan of a chat
  request and its reply as a message (whole) or as protocol-neutral events (ReplyStream).
- llama_api.py: llama-server's /tokenize, /detokenize and /props.
- live.py: the live expert-cache view the page at / plots.
- prometheus.py: /metrics.
- access.py, auth.py: the per-request log line and metrics; --api-key.
- openapi.py: the OpenAPI document at /openapi.json.
- app.py: the Starlette application: routes, middleware, error handlers.
- cli.py: the `sharpi serve` parser and command (and the model options `sharpi chat` shares).

Data flows one way: cli -> app -> (anthropic_api -> openai_api, llama_api, middleware) -> (agents,
body, stops, scheduler, logprobs, prompt); the scheduler never learns that HTTP exists, and the engine never learns that
a server exists.
"""
