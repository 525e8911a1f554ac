"""Issue 11 (2d, 2e, 2k): what a hostile or broken client can no longer do to the gateway.

Capped lists (stop_token_ids, chat messages, content parts), chat templating off the event loop,
JSON content types only (CSRF), a Host check (DNS rebinding), deadlines for headers and bodies
(slowloris), and a stream whose client stops reading is cancelled and its budget released.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from tests.test_gateway_support import ServerThread, start_gateway, wait_until

from gateway.config import Settings
from gateway.hosts import HostCheckMiddleware, allowed_names


def stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/stats", timeout=5).json()


def error_message(r: httpx.Response) -> str:
    body = r.json()
    return body["error"]["message"] if isinstance(body["error"], dict) else body["error"]


CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


# ---- 2d: every list is capped ----

@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}), (CHAT, {"messages": HI})])
def test_stop_token_ids_are_capped(gw_server, gw_worker, path, body):
    before = len(gw_worker.requests)
    r = httpx.post(gw_server.url + path, json={**body, "max_tokens": 2, "stop_token_ids": [2] * 200_000},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop_token_ids"
    assert "200000 token ids; at most 128" in error_message(r)
    r = httpx.post(gw_server.url + path, json={**body, "max_tokens": 2, "stop_token_ids": [2] * 129})
    assert r.status_code == 400 and "at most 128" in error_message(r)
    assert len(gw_worker.requests) == before  # nothing reached a worker

    r = httpx.post(gw_server.url + path, json={**body, "max_tokens": 2, "stop_token_ids": list(range(128))})
    assert r.status_code == 200, r.text
    assert gw_worker.requests[-1].sampling.stop_token_ids == list(range(128))


def test_chat_messages_and_content_parts_are_capped(gw_server, gw_worker):
    before = len(gw_worker.requests)
    empty = {"role": "user", "content": ""}
    # Tens of thousands of messages fit well within the body limit (1 MiB).
    many = json.dumps({"messages": [{"role": "user"}] * 50_000}, separators=(",", ":"))
    t0 = time.monotonic()
    r = httpx.post(gw_server.url + CHAT, content=many, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "50000 messages; at most 1024 are allowed" in error_message(r)
    assert time.monotonic() - t0 < 5  # refused before templating: no stall
    r = httpx.post(gw_server.url + CHAT, json={"messages": [empty] * 1025})
    assert r.status_code == 400 and "at most 1024" in error_message(r)
    part = {"type": "text", "text": "a"}
    r = httpx.post(gw_server.url + CHAT, json={"messages": [{"role": "user", "content": [part] * 257}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    assert len(gw_worker.requests) == before

    r = httpx.post(gw_server.url + CHAT, json={"messages": [{"role": "user", "content": [part] * 256}],
                                               "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- 2e: chat templating runs off the event loop ----

def test_chat_templating_runs_off_the_event_loop(gw_server, gw_worker, gw_tokenizer, monkeypatch):
    threads: list[int] = []
    original = gw_tokenizer.encode_chat

    def recording(messages: list[dict[str, str]], *args, **kwargs) -> list[int]:
        threads.append(threading.get_ident())
        return original(messages, *args, **kwargs)

    monkeypatch.setattr(gw_tokenizer, "encode_chat", recording)
    # Small bodies too: the template's cost grows with the message count, not with the text.
    for messages in (HI, [{"role": "user", "content": ""}] * 100):
        r = httpx.post(gw_server.url + CHAT, json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert len(threads) == 2
    assert gw_server.thread.ident not in threads  # the server thread runs the event loop


# ---- agents send MBs of context: read, parsed and refused without stalling anyone ----

def test_a_prompt_of_many_mb_is_refused_by_its_length_before_tokenizing(gw_server, gw_worker, gw_tokenizer,
                                                                         monkeypatch):
    tokenized: list[int] = []  # the length of each text the tokenizer was given
    hf = gw_tokenizer.hf

    class Recording:  # the model's tokenizer, noting what it tokenizes
        def __getattr__(self, name: str) -> Any:
            return getattr(hf, name)

        def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
            tokenized.append(len(text) if isinstance(text, str) else sum(map(len, text)))
            return hf(text, *args, **kwargs)

    monkeypatch.setattr(gw_tokenizer, "hf", Recording())
    # What a coding agent sends after a long session: tens of turns of code and tool output, 5 MB.
    turn = "def handler(event):\n    return {'status': 200, 'body': event['body']}  # é\n" * 1300
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": turn} for i in range(50)]
    bodies = {CHAT: {"messages": messages, "max_tokens": 100},
              "/v1/completions": {"prompt": turn * 50, "max_tokens": 100}}
    health: list[int] = []
    done = threading.Event()

    def poll_health() -> None:
        while not done.is_set():
            health.append(httpx.get(gw_server.url + "/health", timeout=10).status_code)
            time.sleep(0.01)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        for path, body in bodies.items():
            payload = json.dumps(body).encode()
            assert len(payload) > 5_000_000  # over the old 1 MiB limit, well within the 32 MiB default
            r = httpx.post(gw_server.url + path, content=payload, headers={"content-type": "application/json"},
                           timeout=60)
            assert r.status_code == 400, r.text[:300]
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded", error
            assert "maximum context length is 8192 tokens" in error["message"]
            assert error["param"] == ("messages" if path == CHAT else "prompt")
    finally:
        done.set()
        poller.join(15)
    assert not [n for n in tokenized if n > 1_000_000], tokenized  # refused by its characters alone
    assert health and set(health) == {200}  # the gateway kept answering meanwhile
    r = httpx.post(gw_server.url + CHAT, json={"messages": HI, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_tokenize_of_a_long_text_answers_every_token(gw_server, gw_tokenizer):
    # Hundreds of thousands of ids: the answer is encoded off the event loop in slices, and must
    # read exactly as the small answers do.
    text = "héllo wörld 你好 " * 40_000
    r = httpx.post(gw_server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    ids = gw_tokenizer.encode_text(text)
    assert len(ids) > 200_000
    assert body == {"count": len(ids), "max_model_len": 8192, "tokens": ids,
                    "token_strs": gw_tokenizer.hf.convert_ids_to_tokens(ids)}


# ---- 2k: JSON content types only (CSRF) ----

GENERATION_BODIES = {
    "/generate": {"inputs": "x", "parameters": {"max_new_tokens": 2}},
    "/generate_stream": {"inputs": "x", "parameters": {"max_new_tokens": 2}},
    "/": {"inputs": "x", "parameters": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "x", "max_tokens": 2},
    CHAT: {"messages": HI, "max_tokens": 2},
}


@pytest.mark.parametrize("path", list(GENERATION_BODIES))
def test_a_body_that_is_not_declared_json_is_refused(gw_server, gw_worker, path):
    body = json.dumps(GENERATION_BODIES[path])
    before = len(gw_worker.requests)
    for content_type in ("text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", None):
        headers = {"content-type": content_type} if content_type else {}
        r = httpx.post(gw_server.url + path, content=body, headers=headers)
        assert r.status_code == 415, (content_type, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json")
        assert "application/json" in error_message(r)
        if path.startswith("/v1/"):
            assert r.json()["error"]["type"] == "invalid_request_error"
        else:
            assert r.json()["error_type"] == "unsupported_media_type"
    assert len(gw_worker.requests) == before  # none of them was served
    assert stats(gw_server.url)["rejections"]["unsupported_media_type"] >= 5

    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                         "application/vnd.baton+json"):
        r = httpx.post(gw_server.url + path, content=body, headers={"content-type": content_type})
        assert r.status_code == 200, (content_type, r.text)


# ---- 2k: Host check (DNS rebinding) ----

def test_bound_to_loopback_only_loopback_host_names_are_answered(gw_server, gw_worker):
    body = GENERATION_BODIES["/v1/completions"]
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "10.0.0.1"):
        r = httpx.post(gw_server.url + "/v1/completions", json=body, headers={"host": host})
        assert r.status_code == 400, (host, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and "not allowed" in error_message(r)
        r = httpx.post(gw_server.url + "/generate", json=GENERATION_BODIES["/generate"], headers={"host": host})
        assert r.status_code == 400 and r.json()["error_type"] == "invalid_host"
        for path in ("/stats", "/dashboard", "/metrics"):  # what a rebound page could read
            assert httpx.get(gw_server.url + path, headers={"host": host}).status_code == 400, (path, host)
    for host in ("localhost", f"localhost:{gw_server.port}", "LOCALHOST.", "app.localhost:1", "127.0.0.1",
                 "127.1.2.3:80", "[::1]", "[::1]:8000"):
        r = httpx.post(gw_server.url + "/v1/completions", json=body, headers={"host": host})
        assert r.status_code == 200, (host, r.text)


async def _status_for_host(settings: Settings, host: str) -> int:
    async def ok(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    app = HostCheckMiddleware(ok, allowed_names(settings))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
        return (await client.get("/stats", headers={"host": host})).status_code


@pytest.mark.parametrize("bind,allowed,host,status", [
    ("0.0.0.0", None, "evil.example", 204),  # bound to every interface: any name by default
    ("::", None, "gpu-box.lan:8000", 204),
    ("localhost", None, "evil.example", 400),
    ("::1", None, "evil.example", 400),
    ("127.0.0.1", ("*",), "evil.example", 204),
    ("127.0.0.1", ("baton.example",), "baton.example:443", 204),
    ("0.0.0.0", ("baton.example",), "BATON.example", 204),
    ("0.0.0.0", ("baton.example",), "evil.example", 400),
    ("0.0.0.0", ("baton.example",), "127.0.0.1:8000", 204),  # loopback always: it cannot be rebound
])
def test_host_policy_follows_the_bind_address_and_the_setting(tmp_path, bind, allowed, host, status):
    settings = Settings(model_dir=tmp_path, host=bind, allowed_hosts=allowed)
    assert asyncio.run(_status_for_host(settings, host)) == status


def test_allowed_hosts_flag_and_environment(monkeypatch):
    from gateway.__main__ import parse_args

    monkeypatch.setattr("baton.common.model_files.resolve_model", lambda model: "/nonexistent/model")
    monkeypatch.setenv("BATON_ALLOWED_HOSTS", "a.example, b.example")
    assert parse_args([]).allowed_hosts == ("a.example", "b.example")
    assert parse_args(["--allowed-hosts", "*"]).allowed_hosts == ("*",)
    monkeypatch.delenv("BATON_ALLOWED_HOSTS")
    assert parse_args([]).allowed_hosts is None


# ---- 2k: slow clients (slowloris, a stream nobody reads) ----

class ProductionServer(ServerThread):
    """The gateway as `python -m gateway` serves it (its HTTP protocol and keep-alive), on a
    listening socket we make, optionally with a small send buffer (inherited by connections)."""

    def __init__(self, settings: Settings, tokenizer: Any, send_buffer: int | None = None) -> None:
        from gateway.app import create_app
        from gateway.http_protocol import http_protocol

        self.sock = socket.socket()
        if send_buffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(settings, tokenizer=tokenizer), loop="uvloop", log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=2, http=http_protocol(settings),
                                timeout_keep_alive=settings.keep_alive_timeout)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"gateway-{self.port}")

    def stop(self) -> None:
        super().stop()
        self.sock.close()


@pytest.fixture
def production_server(default_model_dir, gw_redis_url, gw_tokenizer, gw_echo_worker):
    servers: list[ProductionServer] = []

    def start(send_buffer: int | None = None, **overrides: Any) -> ProductionServer:
        settings = Settings(model_dir=default_model_dir, redis_url=gw_redis_url, max_batch_total_tokens=100_000,
                            heartbeat_interval=0.2, **overrides)
        servers.append(ProductionServer(settings, gw_tokenizer, send_buffer).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def connect(port: int, receive_buffer: int | None = None) -> socket.socket:
    sock = socket.socket()
    if receive_buffer is not None:  # before connecting: it sets the TCP window offered
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it does not)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def request_head(path: str, port: int, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_a_body_not_sent_in_time_is_408(default_model_dir, gw_redis_url, gw_tokenizer, gw_worker):
    server = start_gateway(default_model_dir, gw_redis_url, gw_tokenizer, body_read_timeout=0.5)
    try:
        for path in ("/generate", "/v1/completions"):
            with connect(server.port) as sock:
                sock.sendall(request_head(path, server.port, 100) + b'{"inputs": "x"')  # and no more
                t0 = time.monotonic()
                reply = read_until_closed(sock, timeout=10)
                assert time.monotonic() - t0 < 5
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), reply
            assert "body_read_timeout" in json.dumps(json.loads(body))
        assert stats(server.url)["rejections"]["body_timeout"] == 2
    finally:
        server.stop()


def test_headers_not_sent_in_time_close_the_connection(production_server):
    server = production_server(header_read_timeout=0.5)
    with connect(server.port) as sock:  # a first request's headers, trickled
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        assert read_until_closed(sock, timeout=10) == b""
        assert time.monotonic() - t0 < 5

    body = json.dumps({"inputs": "x", "parameters": {"max_new_tokens": 2}}).encode()
    with connect(server.port) as sock:  # a served request, then the next one's headers never complete
        sock.sendall(request_head("/generate", server.port, len(body)) + body)
        sock.settimeout(10)
        reply = b""
        while b"generated_text" not in reply:
            reply += sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        assert read_until_closed(sock, timeout=10) == b""

    r = httpx.post(server.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200  # a client that sends its request normally is served


def test_a_stream_whose_client_stops_reading_is_cancelled(production_server, gw_worker):
    server = production_server(send_buffer=4096, stream_write_timeout=0.5)
    gw_worker.set_reply("word " * 1500)  # ~1500 events: far more than the socket buffers hold
    gw_worker.delay = 0.002  # still generating when the buffers fill (not done before the first stall)
    body = json.dumps({"prompt": "x", "max_tokens": 1800, "stream": True}).encode()
    before = len(gw_worker.requests)
    with connect(server.port, receive_buffer=4096) as sock:
        sock.sendall(request_head("/v1/completions", server.port, len(body)) + body)  # then never reads
        assert wait_until(lambda: len(gw_worker.requests) == before + 1)
        rid = gw_worker.requests[-1].request_id
        # While the client still holds the connection: budget released, workers told to drop it.
        assert wait_until(lambda: stats(server.url)["token_budget"]["in_use"] == 0, timeout=10)
        assert stats(server.url)["requests"] == {"running": 0, "waiting": 0}
        assert wait_until(lambda: stats(server.url)["failed"].get("client_not_reading") == 1), stats(server.url)["failed"]
        assert wait_until(lambda: rid in gw_worker.cancelled_ids())

    # A client that reads gets the whole stream.
    gw_worker.delay = 0.0
    gw_worker.set_reply("word " * 300)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 400, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert wait_until(lambda: stats(server.url)["token_budget"]["in_use"] == 0)
