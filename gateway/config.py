"""Gateway settings: one frozen dataclass, filled by `python -m gateway` from its flags or from the JSON
`baton serve` hands it (`to_json` / `from_json`), or by tests directly."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from baton.common.context_length import model_context_length
from baton.common.service_config import config_from_json, config_to_json

# the context when neither the flags nor the model's config.json say one
FALLBACK_CONTEXT = 2048


def _random_gateway_id() -> str:
    # Short but unique enough: it names this process's token stream and heartbeat key.
    return uuid.uuid4().hex[:12]


# Left out of the JSON: secrets, which travel in REDIS_URL and BATON_API_KEY, and the gateway's
# identity, which each process takes anew (a restarted gateway must not inherit its predecessor's
# token stream and heartbeat: the workers drop that one's requests as orphans).
NOT_IN_JSON = ("redis_url", "api_key", "gateway_id")


@dataclass(frozen=True)
class Settings:
    model_dir: Path
    model_name: str = ""  # the first served name (metrics, /info); set from served_model_names
    # Names a request's `model` may use (vLLM's --served-model-name); empty: (model_name or the
    # model directory's basename,). Any other name gets 404, as vLLM answers.
    served_model_names: tuple[str, ...] = ()
    # --chat-template's text (gateway.chat_template); None: the model's own template.
    chat_template: str | None = None
    # --reasoning-parser / --tool-call-parser (gateway.parsers; vLLM's names). None: no reasoning
    # split; the tool-call parser the chat template calls for (gateway.tools.choose_parser).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # vLLM's --generation-config: "auto" makes the model's generation_config.json sampling keys the
    # requests' defaults, "vllm" ignores them (gateway.sampling_defaults).
    generation_config: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    max_concurrent_requests: int = 128
    # The context: prompt + generated tokens, vLLM's --max-model-len (TGI's --max-total-tokens, the
    # same limit; give one or both equal). None: the model's own (baton.common.context_length), so a
    # model of 32k positions takes 32k-token requests. Resolved in __post_init__ (then never None).
    max_model_len: int | None = None
    max_total_tokens: int | None = None
    # The longest prompt; None: max_total_tokens - 1 (a prompt may use all the context but one token).
    max_input_tokens: int | None = None
    # None: derived from live decode heartbeats (sum of num_kv_blocks_total * block_size).
    max_batch_total_tokens: int | None = None
    max_queue_size: int = 256
    max_queue_wait: float = 30.0  # seconds a request may wait for budget before a 503
    api_key: str | None = None
    # Agent clients (Claude Code, Codex) send MBs of context: read and parsed so that the event loop
    # keeps serving (gateway.validation.read_json_body), a prompt its characters prove too long refused
    # before tokenizing (PromptTokenizer.prompt_ids).
    max_body_bytes: int = 32 << 20
    gateway_id: str = field(default_factory=_random_gateway_id)
    # An admitted request that hears nothing from the workers for this long is ended with an error,
    # so a lost message can never leave a client (and its budget) hanging forever.
    event_timeout: float = 120.0
    heartbeat_interval: float = 1.0
    heartbeat_ttl: float = 5.0
    max_stop_sequences: int = 16
    max_stop_length: int = 128  # characters per stop string
    # Every list a request carries is capped: each is copied into every worker message and Redis
    # entry, and chat messages are templated one by one (tens of thousands stalled the loop).
    max_stop_token_ids: int = 128
    max_chat_messages: int = 1024
    # None: only loopback Host names when bound to loopback (DNS rebinding), any Host otherwise.
    # A list of names allows those (plus loopback); "*" allows any.
    allowed_hosts: tuple[str, ...] | None = None
    # Slow clients must not hold a connection, a slot or token budget forever (slowloris, and an SSE
    # reader that stops reading): seconds to receive a request's headers, then its body, and for
    # one stream event to be accepted by the client's connection.
    header_read_timeout: float = 30.0
    body_read_timeout: float = 30.0
    stream_write_timeout: float = 30.0
    # Longer than the clients' pool expiry (httpx, so openai and huggingface_hub: 5 s), so that the
    # client, not the server, closes an idle connection and never reuses one being closed.
    keep_alive_timeout: int = 10
    retry_after_s: int = 1  # Retry-After on 429/503 answers
    # False (vLLM's behaviour): an unknown request field is ignored, logged once per name and listed
    # in the x-baton-ignored-fields header; True: it is a 4xx naming it (a typo never goes unseen).
    strict_api: bool = False
    # Embeddings (gateway.embeddings.pooling_config): --pooling last|mean|cls and --normalize/--no-normalize;
    # None: what the checkpoint's sentence-transformers files say, else last + normalized.
    pooling: str | None = None
    normalize: bool | None = None
    # Input tokens of the embeddings requests this gateway admits at once (their own lane, apart
    # from the decode budget: gateway.admission); also the most one request may have.
    max_embedding_tokens: int = 65536
    log_level: str = "info"
    log_format: str = "text"  # or "json" (baton.common.logs)
    # SIGTERM: seconds requests in flight get to finish (uvicorn's graceful shutdown) before they are
    # cut. Longer than the workers' drain (30 s), so what a draining worker finishes is delivered.
    shutdown_grace: float = 40.0
    # Seconds a stored Responses answer (`store: true`) is kept in Redis for `previous_response_id`
    # and GET /v1/responses/{id}; 0 stores nothing (then previous_response_id is refused by name).
    responses_ttl: int = 3600
    # Bytes all stored Responses answers may take in Redis together (their JSON, plus 200 each),
    # shared by the gateways of one Redis: past it the soonest to expire are dropped; one larger
    # than all of it is answered with `store: false` (gateway.responses.store).
    responses_max_bytes: int = 64 << 20
    # set by __post_init__: the context the model's config.json declares (None: it declares none)
    model_context: int | None = field(init=False, default=None)
    _conflicting_lengths: bool = field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        # frozen: what is derived here is set through object.__setattr__, once
        resolve = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        resolve("model_dir", Path(self.model_dir))
        names = [n for n in self.served_model_names if n] or [self.model_name or self.model_dir.name]
        resolve("served_model_names", tuple(dict.fromkeys(names)))  # duplicates dropped, order kept
        resolve("model_name", self.served_model_names[0])
        if self.allowed_hosts is not None:  # a list, from JSON
            resolve("allowed_hosts", tuple(self.allowed_hosts))
        resolve("model_context", model_context_length(self.model_dir))  # what the model's config declares
        total = self.max_total_tokens or self.max_model_len
        if total is None:  # the model's, within a fixed budget when one is set (one request must fit it)
            total = self.model_context or FALLBACK_CONTEXT
            if self.max_batch_total_tokens is not None:
                total = min(total, self.max_batch_total_tokens)
        resolve("_conflicting_lengths", bool(self.max_total_tokens and self.max_model_len
                                             and self.max_total_tokens != self.max_model_len))
        resolve("max_total_tokens", total)
        resolve("max_model_len", total)
        if self.max_input_tokens is None:
            resolve("max_input_tokens", max(1, total - 1))

    def to_json(self) -> str:
        """These settings as `baton serve` hands them to a gateway (without NOT_IN_JSON). Only
        settings that validate travel: the lengths are resolved here, and a conflict between
        --max-model-len and --max-total-tokens could not be seen again from the JSON."""
        self.validate()
        return config_to_json(self, NOT_IN_JSON)

    @classmethod
    def from_json(cls, text: str, *, redis_url: str, api_key: str | None) -> Settings:
        """`to_json`'s settings back, with the secrets from where they travel (a new gateway_id)."""
        return config_from_json(cls, text, redis_url=redis_url, api_key=api_key)

    def validate(self) -> None:
        """Refuse settings that would make some valid-looking request impossible to serve."""
        assert self.max_input_tokens is not None and self.max_total_tokens is not None  # __post_init__
        if self._conflicting_lengths:
            raise ValueError("--max-model-len and --max-total-tokens name the same limit: give one of them")
        if self.model_context is not None and self.max_total_tokens > self.model_context:
            raise ValueError(f"--max-model-len {self.max_total_tokens} is longer than the model's context "
                             f"({self.model_context} tokens, from its config.json): positions past it were never "
                             f"trained; give at most {self.model_context}")
        if self.max_input_tokens < 1:
            raise ValueError("--max-input-tokens must be >= 1")
        if self.max_total_tokens <= self.max_input_tokens:
            raise ValueError("--max-total-tokens (the context, --max-model-len) must be greater than --max-input-tokens")
        if self.max_batch_total_tokens is not None and self.max_batch_total_tokens < self.max_total_tokens:
            # Like TGI: a request of max_total_tokens must fit the batch budget on its own.
            raise ValueError("--max-batch-total-tokens must be >= --max-total-tokens")
        if self.max_concurrent_requests < 1:
            raise ValueError("--max-concurrent-requests must be >= 1")
        if self.max_queue_size < 0:
            raise ValueError("--max-queue-size must be >= 0")
        if self.max_embedding_tokens < 1:
            raise ValueError("--max-embedding-tokens must be >= 1")
        if self.max_queue_wait <= 0:
            raise ValueError("--max-queue-wait must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be >= 1024")
        if self.shutdown_grace < 0:
            raise ValueError("--shutdown-grace must be >= 0")
        if self.responses_ttl < 0:
            raise ValueError("--responses-ttl must be >= 0")
        if self.responses_max_bytes < 1:
            raise ValueError("--responses-max-bytes must be >= 1")
        if self.event_timeout <= 0:
            raise ValueError("--event-timeout must be > 0")
        if self.max_stop_token_ids < 0 or self.max_chat_messages < 1:
            raise ValueError("max_stop_token_ids must be >= 0 and max_chat_messages >= 1")
        for name in ("header_read_timeout", "body_read_timeout", "stream_write_timeout", "keep_alive_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
