"""Baton's HTTP gateway: TGI- and OpenAI-compatible APIs in front of the prefill/decode workers.

Map of the package (one responsibility per module):
    __main__        `python -m gateway`: flags -> Settings -> uvicorn (uvloop)
    http_protocol   uvicorn's h11 protocol with a deadline for request headers (slowloris)
    config          Settings dataclass
    app             create_app(): routes, middleware, lifespan (the Redis runtime, or the in-memory one)
    services        the long-lived parts shared by handlers
    spec            GenerationSpec: prompt + SamplingParams + API view + choices
    validation*     body reading (size, UTF-8, JSON) and per-API field checks -> GenerationSpec
    sampling_defaults  the model's generation_config.json sampling defaults (--generation-config)
    tokenizer       the model's tokenizer; prompt limits (max_input_tokens, max_total_tokens)
    admission       the one task that owns the token budget and the FIFO wait queue
    router          the one task that reads this gateway's token stream and routes events
    cluster         heartbeats: ours out, workers' in (token budget, /stats); Redis health
    backend         the seam to the workers: send prefills and cancels (Redis, or in memory)
    generation      one request's life: admit, send to prefill, events -> text, cancel, release
    lifecycle       a generation's named states and the transitions allowed between them
    choices         one request's generations: validate, tokenize, admit as one, send, read
    siblings        n / best_of: sibling seeds, sending siblings late, best_of's ranking
    detokenizer     incremental detokenization (no split characters) and stop sequences
    respond         glue shared by routes: start, wait for the end, SSE response with cleanup
    routes_tgi      /generate, /generate_stream, POST /
    routes_openai   /v1/completions, /v1/chat/completions
    routes_misc     /health, /info, /stats, /metrics, /v1/models, /openapi.json
    openapi         the hand-written OpenAPI document
    hosts           the Host header check (DNS rebinding)
    auth            the API key, deny by default: every route but the probes (/health, /metrics, ...)
    dashboard_login the dashboard's login form and session cookie (a browser sends no header)
    errors, metrics
"""
