"""The API key, deny by default, against a real gateway on uvicorn: every route the app serves and
every operation /openapi.json documents answers 401 without the key (a route added later is covered
without anyone listing it), except the named probes; both headers work; and a flood of made-up
methods and random paths, with or without the key, adds only a bounded number of metric series.

(The dashboard's browser login is tested in tests/test_dashboard.py.)
"""

from __future__ import annotations

import random
import re
import string

import httpx
import pytest
from starlette.routing import BaseRoute, Mount, Route

from tests.test_gateway_support import private_db, start_gateway

KEY = "s3cret-key"
# The list, spelled out here: opening another route must change this test, on purpose.
OPEN_WITHOUT_KEY = {"/health", "/ready", "/live", "/metrics", "/version"}
LOGIN = "/dashboard/login"  # open by nature: it checks the key the form carries (401 when wrong)
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")
_PARAM = re.compile(r"\{(\w+)(?::(\w+))?\}")
_SAMPLE_VALUES = {"int": "1", "float": "1.5", "uuid": "00000000-0000-0000-0000-000000000000"}


def concrete(template: str) -> str:
    """A request path for a route template: each `{param[:convertor]}` replaced by a value it accepts."""
    return _PARAM.sub(lambda m: _SAMPLE_VALUES.get(m.group(2) or "str", "resp_x1"), template)


def served(routes: list[BaseRoute], prefix: str = "") -> set[tuple[str, str]]:
    """(method, path template) of every route, Mounts' sub-routes included."""
    out: set[tuple[str, str]] = set()
    for route in routes:
        if isinstance(route, Mount):
            out |= served(route.routes, prefix + route.path)
        elif isinstance(route, Route):
            out |= {(method, prefix + route.path) for method in (route.methods or METHODS)}
        else:
            raise AssertionError(f"a route of a kind this test does not enumerate: {route!r}")
    return out


@pytest.fixture(scope="module")
def keyed(default_model_dir, redis_url, gw_tokenizer):
    server = start_gateway(default_model_dir, private_db(redis_url, 10), gw_tokenizer, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def every_operation(keyed) -> set[tuple[str, str]]:
    """(method, path template): what the app routes and what its OpenAPI document names, together."""
    from gateway.auth import OPEN_ROUTES

    assert OPEN_ROUTES == OPEN_WITHOUT_KEY
    routes = served(keyed.server.config.app.routes)
    spec = httpx.get(keyed.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    documented = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    assert ("POST", "/v1/responses") in routes and ("DELETE", "/v1/responses/{response_id}") in documented
    return routes | documented


def test_every_route_and_documented_operation_needs_the_key(keyed, every_operation):
    paths = {path for _, path in every_operation}
    wrong = []
    with httpx.Client(base_url=keyed.url, timeout=10) as client:
        # Every path with every method: one it does not serve must be refused too, not answered 405.
        for path in sorted(paths):
            for method in METHODS:
                r = client.request(method, concrete(path), json={} if method in ("POST", "PUT", "PATCH") else None)
                if path in OPEN_WITHOUT_KEY and method in ("GET", "HEAD"):
                    if r.status_code == 401:
                        wrong.append((method, path, "open route refused"))
                elif r.status_code != 401:
                    wrong.append((method, path, r.status_code))
        # A path no route serves, and a name the router would redirect (trailing slash), are refused too.
        for path in ("/nope", "/health/", "/v1/responses/", "//v1/embeddings"):
            if client.get(path).status_code != 401:
                wrong.append(("GET", path, "unknown path answered"))
    assert not wrong, wrong


def test_every_operation_is_served_with_the_key(keyed, every_operation):
    """With the key (either header) nothing is a 401: bodies are `{}`, so no generation starts."""
    wrong = []
    with httpx.Client(base_url=keyed.url, timeout=10) as client:
        for i, (method, path) in enumerate(sorted(every_operation)):
            if path == LOGIN:  # authenticates by its form's field, not a header (tests/test_dashboard.py)
                continue
            headers = {"Authorization": f"Bearer {KEY}"} if i % 2 else {"x-api-key": KEY}
            r = client.request(method, concrete(path), headers=headers,
                               json={} if method in ("POST", "PUT", "PATCH") else None)
            if r.status_code in (401, 405) or (r.status_code >= 500 and path != "/ready"):
                wrong.append((method, path, r.status_code, r.text[:120]))
    assert not wrong, wrong


def test_errors_for_a_missing_and_a_wrong_key_say_which(keyed):
    r = httpx.post(keyed.url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.json()["error"]["message"].startswith("missing API key") and r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(keyed.url + "/embed", json={"inputs": "x"}, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"] == "invalid API key"
    r = httpx.delete(keyed.url + "/v1/responses/resp_x1", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"


def http_series(metrics_text: str) -> set[str]:
    return {line.rsplit(" ", 1)[0] for line in metrics_text.splitlines()
            if line.startswith("baton:http_requests_total{")}


def test_a_flood_of_made_up_methods_and_paths_adds_few_metric_series(keyed):
    from gateway.http_metrics import STANDARD_METHODS

    rng = random.Random(38)

    def made_up(length: int) -> str:
        return "".join(rng.choice(string.ascii_uppercase) for _ in range(length))

    with httpx.Client(base_url=keyed.url, timeout=10) as client:
        before = http_series(client.get("/metrics").text)
        for credentials in ({}, {"Authorization": f"Bearer {KEY}"}):
            for _ in range(150):  # the attack: distinct long methods (405 with the key, 401 without)
                client.request(made_up(256), "/v1/models", headers=credentials)
            for _ in range(150):  # random paths (404 with the key)
                client.get("/" + made_up(40).lower(), headers=credentials)
            client.request("get", "/v1/models", headers=credentials)  # methods are case-sensitive
        text = client.get("/metrics").text
    after = http_series(text)
    # At most: {other, GET} x {/v1/models, unmatched} x {401, 404, 405} and the /metrics scrape itself.
    assert len(after - before) <= 8, sorted(after - before)
    routes = {route.path for route in keyed.server.config.app.routes} | {"unmatched"}
    for series in after:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', series))
        assert labels["method"] in STANDARD_METHODS | {"other"}, series
        assert labels["endpoint"] in routes, series
    assert len(text) < 200_000, len(text)
