"""Baton's HTTP gateway: TGI-, OpenAI- and Anthropic-compatible APIs in front of the prefill/decode workers.

One package per API, each holding its routes, request validation, reply and its part of the
OpenAPI document (openapi: paths and schemas); the HTTP core they share stays at the top level. An
API's package imports the core (and the chat-shaped APIs import gateway.openai, whose chat pipeline
they translate into); the core imports an API's package only to mount its routes (app) or document
it (openapi).

Per API:
    openai/         /v1/completions, /v1/chat/completions
        routes          the endpoints: whole answers and SSE streams
        validation      OpenAI bodies -> GenerationSpec (parse_chat, parse_completion, served_model)
        reply           OpenAIReply: one answer over its choices, whole or as chunks
        openapi         its paths and schemas in /openapi.json
    responses/      /v1/responses (OpenAI's Responses API), GET / DELETE /v1/responses/{id}
        routes, validation (-> a chat body), output (chat's answer -> Responses items and events),
        store (stored responses in Redis, previous_response_id), openapi (its part of /openapi.json)
    anthropic/      /v1/messages, /v1/messages/count_tokens
        routes, validation (-> a chat body), reply (chat's answer in the Messages shape), openapi
    tgi/            /generate, /generate_stream, POST /
        routes, validation (TGI bodies -> GenerationSpec), parameters (the scalar parameters' table:
        the validator's checks and the schema both), openapi (its part of /openapi.json)
    embeddings/     /v1/embeddings (OpenAI), /embed (TEI)
        routes, validation (-> EmbeddingSpec), job (one request = one prefill-only job),
        pooling_config (how this model pools and normalizes), openapi (its part of /openapi.json)
    tokenize/       /tokenize, /detokenize (vLLM's)
        routes, openapi

The HTTP core:
    __main__        `python -m gateway`: flags -> Settings -> uvicorn (uvloop)
    http_protocol   uvicorn's h11 protocol with a deadline for request headers (slowloris)
    config          Settings dataclass
    app             create_app(): routes, middleware, lifespan (the Redis runtime, or the in-memory one)
    services        the long-lived parts shared by handlers
    generation_spec GenerationSpec: prompt + SamplingParams + API view + choices
    validation      body reading (size, UTF-8, JSON) and the field checks every API's validation uses
    structured      structured-output fields (OpenAI's and TGI's) -> one compiled constraint
    tools           chat tools: tools, tool_choice, tool messages, tool_calls answers
    parsers/        output parsers for chat answers: reasoning and tool calls
    sampling_defaults  the model's generation_config.json sampling defaults (--generation-config)
    chat_template   --chat-template: a Jinja chat template replacing the model's own
    tokenizer       the model's tokenizer; prompt limits (max_input_tokens, max_total_tokens)
    loop_gate       one-at-a-time gates for work moved off the event loop
    admission       the one task that owns the token budget and the FIFO wait queue
    router          the one task that reads this gateway's token stream and routes events
    cluster         heartbeats: ours out, workers' in (token budget, /stats); Redis health
    backend         the seam to the workers: send prefills and cancels (Redis, or in memory)
    generation      one request's life: admit, send to prefill, events -> text, cancel, release
    lifecycle       a generation's named states and the transitions allowed between them
    choices         one request's generations: validate, tokenize, admit as one, send, read
    siblings        n / best_of: sibling seeds, sending siblings late, best_of's ranking
    detokenizer     incremental detokenization (no split characters) and stop sequences
    finish          each API's spelling of how a generation ended
    logprobs_format log-probabilities in OpenAI's and TGI's shapes
    respond         glue shared by routes: start, wait for the end, SSE response with cleanup
    request_scope   every generation a request starts is released when its HTTP exchange ends
    request_ids     x-request-id: honoured, echoed, logged
    routes_misc     /health, /ready, /live, /info, /stats, /metrics, /v1/models, /version, /openapi.json
    openapi         the OpenAPI document: the core's paths and every API package's part
    openapi_schemas the schemas no one API owns (error shapes, the dashboard's data), shared pieces
    hosts           the Host header check (DNS rebinding)
    auth            the API key, deny by default: every route but the probes (/health, /metrics, ...)
    dashboard       /dashboard (static/dashboard.html) and /dashboard/data
    dashboard_login the dashboard's login form and session cookie (a browser sends no header)
    errors          one error type, rendered in each API's shape
    metrics, http_metrics  Prometheus metrics: the gateway's, and requests by endpoint
"""
