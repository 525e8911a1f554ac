"""Test support (no tests here): a stand-in for the Hugging Face Hub on a loopback port.

It answers the requests huggingface_hub's `snapshot_download` makes, with the headers it reads:
  GET  /api/models/{repo}/revision/{rev}      repo info: `sha` (the commit) and `siblings`
  GET  /api/models/{repo}/tree/{commit}       the file listing (path, size, git oid, lfs sha256)
  HEAD /{repo}/resolve/{rev}/{file}           X-Repo-Commit, ETag / X-Linked-Etag, Content-Length
  GET  /{repo}/resolve/{rev}/{file}           the bytes
An unknown repo is answered as the Hub answers it (401 with X-Error-Code: RepoNotFound), a repo
made private needs `Authorization: Bearer <token>`, and every request is recorded so that tests
can tell whether a download (or any traffic at all) happened.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # 40 hex digits: what the Hub calls a revision


@dataclass
class HubRepo:
    files: dict[str, bytes]
    token: str | None = None  # set: a private repo, only for `Authorization: Bearer <token>`

    @classmethod
    def from_dir(cls, directory: Path, token: str | None = None) -> HubRepo:
        return cls({p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}, token)


@dataclass
class HubStandIn:
    repos: dict[str, HubRepo]
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)

    def start(self) -> HubStandIn:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="hub-standin")
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def downloads(self) -> list[str]:
        """The files whose bytes were sent (GET on resolve/)."""
        return [path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path in self.requests
                if method == "GET" and "/resolve/" in path]


def _git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".gguf"))  # as on the Hub: weights are LFS files, the rest plain git


def _handler_for(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: pytest shows failures, not traffic
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            if path.startswith("/api/models/"):
                self._api(path.removeprefix("/api/models/"), body)
            elif "/resolve/" in path:
                repo_id, rest = path.lstrip("/").split("/resolve/", 1)
                _rev, filename = rest.split("/", 1)
                self._file(repo_id, filename, body)
            else:
                self._send(404, b"not found", {"Content-Type": "text/plain"}, body)

        def _repo(self, repo_id: str, body: bool) -> HubRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is not None and repo.token is not None \
                    and self.headers.get("Authorization") != f"Bearer {repo.token}":
                repo = None  # the Hub does not tell a private repo from a missing one
            if repo is None:
                self._send(401, b'{"error": "Repository not found"}',
                           {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound",
                            "X-Error-Message": "Repository not found"}, body)
            return repo

        def _api(self, rest: str, body: bool) -> None:
            for marker in ("/revision/", "/tree/"):
                if marker in rest:
                    repo_id = rest.split(marker, 1)[0]
                    break
            else:
                self._send(404, b"{}", {"Content-Type": "application/json"}, body)
                return
            repo = self._repo(repo_id, body)
            if repo is None:
                return
            if marker == "/revision/":
                info = {"id": repo_id, "modelId": repo_id, "sha": COMMIT, "private": repo.token is not None,
                        "siblings": [{"rfilename": name} for name in repo.files]}
            else:
                info = [{"type": "file", "path": name, "size": len(data), "oid": _git_blob_oid(data),
                         **({"lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                     "pointerSize": 134}} if _is_lfs(name) else {})}
                        for name, data in repo.files.items()]
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

        def _file(self, repo_id: str, filename: str, body: bool) -> None:
            repo = self._repo(repo_id, body)
            if repo is None:
                return
            data = repo.files.get(filename)
            if data is None:
                self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT},
                           body)
                return
            etag = hashlib.sha256(data).hexdigest() if _is_lfs(filename) else _git_blob_oid(data)
            headers = {"Content-Type": "application/octet-stream", "X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}
            if _is_lfs(filename):
                headers["X-Linked-Etag"] = f'"{etag}"'
                headers["X-Linked-Size"] = str(len(data))
            self._send(200, data, headers, body)

        def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler
