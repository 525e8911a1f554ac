"""One error type for every client-visible failure, rendered in the shape each API's clients parse.

TGI clients (huggingface_hub) read `{"error": msg, "error_type": kind}` and pick the exception class
from `error_type`; OpenAI clients read `{"error": {"message", "type", "param", "code"}}` and pick the
class from the HTTP status. Handlers raise `ApiError`; the app's exception handler renders it for
the API family the path belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse

from gateway.request_ids import HEADER, client_request_id

ApiStyle = Literal["tgi", "openai", "anthropic"]

# Our error kinds -> OpenAI's error `type` strings.
_OPENAI_TYPES = {
    "validation": "invalid_request_error",
    "overloaded": "overloaded",
    "unavailable": "service_unavailable",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "model_not_found": "NotFoundError",  # vLLM's answer to an unknown `model`
    "payload_too_large": "invalid_request_error",
    "unsupported_media_type": "invalid_request_error",
    "invalid_host": "invalid_request_error",
    "generation": "server_error",
    "timeout": "timeout",
}


class ApiError(Exception):
    """An error answer: HTTP status, a clear message, and a kind that names the failure class."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "validation",
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
        context: ContextOverflow | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = headers or {}
        self.code = code  # OpenAI's machine-readable `code` (else the status)
        self.context = context  # a request past the context: each API words it its own way


@dataclass(frozen=True)
class ContextOverflow:
    """A request longer than the context: its prompt tokens, the tokens it asks to generate (0 when
    the prompt alone is too long) and the limit it passed."""

    prompt_tokens: int
    completion_tokens: int
    limit: int
    prompt_limit: int  # the longest prompt (--max-input-tokens)

    def openai_message(self) -> str:
        # the sentence the openai, LangChain and LiteLLM clients recognise as "context too long"
        if self.completion_tokens == 0:
            return (f"This model's maximum context length is {self.limit} tokens and prompts may have at most "
                    f"{self.prompt_limit}. However, your prompt has {self.prompt_tokens} tokens. "
                    "Please reduce the length of the prompt.")
        return (f"This model's maximum context length is {self.limit} tokens. However, you requested "
                f"{self.prompt_tokens + self.completion_tokens} tokens ({self.prompt_tokens} in the prompt, "
                f"{self.completion_tokens} in the completion). Please reduce the length of the prompt or "
                "the completion.")

    def anthropic_message(self) -> str:
        if self.completion_tokens == 0:
            return f"prompt is too long: {self.prompt_tokens} tokens > {self.prompt_limit} maximum"
        return (f"input length and `max_tokens` exceed context limit: {self.prompt_tokens} + "
                f"{self.completion_tokens} > {self.limit}, decrease input length or `max_tokens` and try again")

    def tgi_message(self) -> str:
        if self.completion_tokens == 0:
            return (f"Input validation error: `inputs` must have less than {self.prompt_limit + 1} tokens. "
                    f"Given: {self.prompt_tokens}")
        return (f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {self.limit}. "
                f"Given: {self.prompt_tokens} `inputs` tokens and {self.completion_tokens} `max_new_tokens`")


def validation_error(message: str, *, param: str | None = None, status: int = 422) -> ApiError:
    return ApiError(status, message, kind="validation", param=param)


def context_length_exceeded(overflow: ContextOverflow, *, param: str | None, status: int) -> ApiError:
    """A request past the context: OpenAI's `context_length_exceeded` (its clients match the code
    and the "maximum context length" sentence), Anthropic's and TGI's own wording on their routes."""
    return ApiError(status, overflow.openai_message(), kind="validation", param=param,
                    code="context_length_exceeded", context=overflow)


def overloaded(message: str, retry_after_s: int) -> ApiError:
    return ApiError(429, message, kind="overloaded", headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int) -> ApiError:
    return ApiError(503, message, kind="unavailable", headers={"Retry-After": str(retry_after_s)})


# vLLM's endpoints outside /v1: their clients parse OpenAI-shaped errors.
OPENAI_PATHS = frozenset({"/tokenize", "/detokenize"})


# Anthropic's Messages API (its clients parse `{"type": "error", "error": {"type", "message"}}`).
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
# Anthropic's error `type` by status (its SDK picks the exception class by status). Overloaded
# stays our 503 (Anthropic's own is 529) with its Retry-After: what every client here retries on.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def api_style(path: str) -> ApiStyle:
    """Which error shape a path's clients expect: the OpenAI API lives under /v1, but for Anthropic's."""
    if path in ANTHROPIC_PATHS:
        return "anthropic"
    return "openai" if path.startswith("/v1/") or path == "/v1" or path in OPENAI_PATHS else "tgi"


def error_body(err: ApiError, style: ApiStyle) -> dict[str, Any]:
    if style == "tgi":
        return {"error": err.context.tgi_message() if err.context else err.message, "error_type": err.kind}
    if style == "anthropic":
        kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
        if err.context is not None:
            return {"type": "error", "error": {"type": kind, "message": err.context.anthropic_message()}}
        # No `param` in Anthropic's body: its messages lead with the field ("max_tokens: ...").
        named = not err.param or f"`{err.param}`" in err.message
        return {"type": "error", "error": {"type": kind, "message": err.message if named
                                           else f"{err.param}: {err.message}"}}
    code: int | str | None = err.code or err.status
    if err.kind == "authentication":
        code = "invalid_api_key"
    return {
        "error": {
            "message": err.message,
            "type": _OPENAI_TYPES.get(err.kind, "server_error"),
            "param": err.param,
            "code": code,
        }
    }


def error_response(err: ApiError, style: ApiStyle, headers: dict[str, str] | None = None) -> JSONResponse:
    """`headers`: the route's own (x-request-id) besides the error's (Retry-After)."""
    return JSONResponse(error_body(err, style), status_code=err.status,
                        headers={**err.headers, **(headers or {})})


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette exception handler for ApiError."""
    assert isinstance(exc, ApiError)
    return error_response(exc, api_style(request.url.path))


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 as JSON in the path's error shape (never an HTML or text body)."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    kind = {404: "not_found", 405: "validation"}.get(status, "validation")
    message = f"{request.method} {request.url.path}: {detail}"
    return error_response(ApiError(status, message, kind=kind), api_style(request.url.path))


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Last resort: a bug must still answer JSON the clients can parse, never a bare 500 page."""
    err = ApiError(500, f"internal error: {type(exc).__name__}", kind="generation")
    # Answered by Starlette's outermost middleware, past RequestIdMiddleware: add the id here.
    return error_response(err, api_style(request.url.path), {HEADER: client_request_id(request.scope)})
