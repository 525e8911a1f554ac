"""The OpenAPI 3 description of every gateway endpoint (served at /openapi.json).

Hand-written on purpose: the wire formats are dictated by the clients (TGI, OpenAI), not derived
from our code, so this file states the contract and tests check the endpoints against it. Where a
validator checks fields from a table, the schema is written from that table instead, so the two
cannot drift apart: TGI's scalar `parameters` (gateway.tgi.parameters). The APIs with a part of
their own part (each API's package: gateway.tgi, gateway.openai, ...) give their paths and schemas here.
"""

from __future__ import annotations

import copy
from typing import Any

from gateway.anthropic.openapi import MESSAGES_SCHEMAS, messages_paths
from gateway.auth import COOKIE_ROUTES, is_open
from gateway.config import Settings
from gateway.dashboard_login import COOKIE_NAME, LOGIN_PATH
from gateway.embeddings.openapi import EMBEDDINGS_SCHEMAS, embeddings_paths
from gateway.openai.openapi import OPENAI_SCHEMAS, openai_paths
from gateway.openapi_schemas import _INT, SCHEMAS, _ref
from gateway.responses.openapi import RESPONSES_SCHEMAS, responses_paths
from gateway.tgi.openapi import TGI_SCHEMAS, tgi_paths
from gateway.tokenize.openapi import TOKENIZE_SCHEMAS, tokenize_paths


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _tgi_errors() -> dict[str, Any]:
    e = _ref("TgiError")
    return {
        "400": _json(e, "Host header not allowed (error_type `invalid_host`)."),
        "401": _json(e, "Missing or wrong API key (when one is configured)."),
        "408": _json(e, "Body not received within --body-read-timeout (error_type `timeout`)."),
        "413": _json(e, "Request body larger than --max-body-bytes."),
        "415": _json(e, "Content-Type is not application/json (error_type `unsupported_media_type`)."),
        "422": _json(e, "Invalid request (error_type `validation`)."),
        "429": _json(e, "Overloaded (error_type `overloaded`): too many requests in flight or queue full."),
        "500": _json(e, "Generation failed after admission (error_type `generation`)."),
        "503": _json(e, "Redis unreachable or restarted (the request's state was lost: retry), or "
                      "waited longer than --max-queue-wait for admission."),
    }


# On every generation endpoint's 200: the unknown fields that were ignored (never with --strict-api).
_IGNORED_HEADER = {"x-baton-ignored-fields": {
    "description": "Unknown request fields that were ignored, comma-separated (percent-encoded; nested "
                   "ones prefixed, e.g. `parameters.foo`). Absent when there were none.",
    "schema": {"type": "string"}}}


def _openai_errors() -> dict[str, Any]:
    e = _ref("OpenAIError")
    return {
        "400": _json(e, "Invalid request or Host header not allowed (type `invalid_request_error`)."),
        "401": _json(e, "Missing or wrong API key (when one is configured)."),
        "408": _json(e, "Body not received within --body-read-timeout (type `timeout`)."),
        "413": _json(e, "Request body larger than --max-body-bytes."),
        "404": _json(e, "`model` names no served model (type `NotFoundError`, param `model`, code 404)."),
        "415": _json(e, "Content-Type is not application/json."),
        "429": _json(e, "Overloaded (type `overloaded`, code 429); see Retry-After."),
        "500": _json(e, "Generation failed after admission."),
        "503": _json(e, "Redis unreachable or restarted (the request's state was lost: retry), or "
                      "waited longer than --max-queue-wait for admission."),
    }



def _anthropic_errors() -> dict[str, Any]:
    e = _ref("AnthropicError")
    return {
        "400": _json(e, "Invalid request (type `invalid_request_error`; the message names the field)."),
        "401": _json(e, "Missing or wrong API key (`x-api-key` or Bearer; type `authentication_error`)."),
        "404": _json(e, "`model` names no served model (type `not_found_error`)."),
        "413": _json(e, "Request body larger than --max-body-bytes (type `request_too_large`)."),
        "429": _json(e, "Overloaded (type `rate_limit_error`); see Retry-After."),
        "500": _json(e, "Generation failed after admission (type `api_error`)."),
        "503": _json(e, "Redis unreachable, or waited longer than --max-queue-wait (type `overloaded_error`; "
                      "Anthropic's own status for it is 529); see Retry-After."),
    }


def openapi_spec(settings: Settings) -> dict[str, Any]:
    generation_security: list[dict[str, list[str]]] = [{"bearer": []}] if settings.api_key else []

    def op(summary: str, responses: dict[str, Any], body: dict[str, Any] | None = None,
           secured: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"summary": summary, "responses": responses}
        if body is not None:
            out["requestBody"] = body
        if secured:
            out["security"] = generation_security
        return out

    paths = {
        **tgi_paths(op, _json, _tgi_errors(), _IGNORED_HEADER),
        **openai_paths(op, _openai_errors(), _IGNORED_HEADER),
        "/v1/models": {"get": op("OpenAI: the served model names", {"200": _json(
            {"type": "object", "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": {
                "type": "object", "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                                 "root": {"type": "string"}, "max_model_len": _INT}}}}},
            "One entry per --served-model-name, the default (first) one first.")}, secured=True)},
        **tokenize_paths(op, _json, _openai_errors(), _IGNORED_HEADER),
        **messages_paths(op, _json, _anthropic_errors(), _IGNORED_HEADER),
        "/version": {"get": op("The baton package version", {"200": _json(
            {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}},
            "vLLM's shape.")})},
        "/info": {"get": op("TGI-style model and limits", {"200": _json({"type": "object"},
            "model_id, max_input_tokens, max_total_tokens, max_concurrent_requests, ...")})},
        "/health": {"get": op("Liveness: Redis reachable", {
            "200": _json({"type": "object"}, "Redis answers; counts of live workers."),
            "503": _json(_ref("TgiError"), "Redis unreachable.")})},
        "/ready": {"get": op("Readiness: Redis reachable and a live prefill and decode worker", {
            "200": _json({"type": "object"}, "Ready to serve; counts of live workers."),
            "503": _json({"type": "object"}, "Not ready: `missing` names what is missing.")})},
        "/live": {"get": op("Liveness: the process serves and its background tasks run (not Redis)", {
            "200": _json({"type": "object"}, "Alive."),
            "503": _json(_ref("TgiError"), "A background task stopped: restart.")})},
        "/stats": {"get": op("Token budget, running/waiting requests, rejections, worker heartbeats",
                             {"200": _json({"type": "object"}, "Gateway state.")}, secured=True)},
        "/dashboard": {"get": op("Live dashboard: one self-contained HTML page (no external assets) that polls "
                                 "/dashboard/data every second", {
            "200": {"description": "The dashboard page.", "content": {"text/html": {"schema": {"type": "string"}}}},
            "401": _json(_ref("TgiError"), "Missing or wrong API key (when one is configured).")}, secured=True)},
        "/dashboard/data": {"get": op("The dashboard's data: current state, time series, worker health", {
            "200": _json(_ref("DashboardData"), "Sampled once a second by the gateway."),
            "401": _json(_ref("TgiError"), "Missing or wrong API key (when one is configured).")}, secured=True)},
        "/metrics": {"get": op("Prometheus metrics (baton:*)", {
            "200": {"description": "Prometheus text format.",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}})},
        "/openapi.json": {"get": op("This document", {"200": _json({"type": "object"}, "OpenAPI 3 document.")})},
        LOGIN_PATH: {"post": op("Dashboard login (a browser's way in when an API key is configured)", {
            "303": {"description": "The key was right: a session cookie for the dashboard's GETs "
                                   "(HttpOnly, SameSite=Strict), and back to /dashboard."},
            "401": {"description": "Wrong or no key: the login form again, no cookie.",
                    "content": {"text/html": {"schema": {"type": "string"}}}}},
            {"required": True, "content": {"application/x-www-form-urlencoded": {"schema": {
                "type": "object", "required": ["key"], "properties": {"key": {"type": "string"}}}}}})},
    }
    paths.update(responses_paths(op, _json, _openai_errors(), _IGNORED_HEADER))
    paths.update(embeddings_paths(op, _json, _openai_errors(), _tgi_errors(), _IGNORED_HEADER))
    if settings.api_key:
        _mark_security(paths)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Baton gateway", "version": "0.1.0",
                 "description": f"Serves `{settings.model_name}` with TGI- and OpenAI-compatible APIs. "
                                f"Limits: max_input_tokens={settings.max_input_tokens}, "
                                f"max_total_tokens={settings.max_total_tokens}."},
        "paths": paths,
        "components": {"schemas": _schemas(settings),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                                           "dashboard_session": {"type": "apiKey", "in": "cookie",
                                                                 "name": COOKIE_NAME}}},
    }


def _mark_security(paths: dict[str, Any]) -> None:
    """Every operation gateway.auth does not leave open needs the key (deny by default): marked here by
    the same rule, so the document cannot miss a route."""
    for path, operations in paths.items():
        for method, operation in operations.items():
            if is_open(path, method.upper()):
                continue
            operation["security"] = [{"bearer": []}, {"x_api_key": []}]
            if path in COOKIE_ROUTES and method == "get":
                operation["security"].append({"dashboard_session": []})


def _schemas(settings: Settings) -> dict[str, Any]:
    """SCHEMAS with this gateway's served names as the values `model` may take."""
    schemas = copy.deepcopy({**SCHEMAS, **TGI_SCHEMAS, **OPENAI_SCHEMAS, **TOKENIZE_SCHEMAS, **MESSAGES_SCHEMAS,
                             **RESPONSES_SCHEMAS, **EMBEDDINGS_SCHEMAS})
    schemas["OpenAICommon"]["properties"]["model"]["enum"] = list(settings.served_model_names)
    schemas["MessagesCountTokensRequest"]["properties"]["model"]["enum"] = list(settings.served_model_names)
    return schemas
