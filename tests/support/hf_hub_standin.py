"""A loopback stand-in for the Hugging Face hub, reached through ``HF_ENDPOINT``.

It serves the part of the hub's HTTP API that ``huggingface_hub`` (2.4) uses for
``snapshot_download``, with the headers it checks:

- ``GET /api/models/<id>/revision/<rev>``: the repo info (``sha``: the commit ``rev`` names);
- ``GET /api/models/<id>/tree/<commit>?recursive=...``: the file listing (git blob ids; LFS
  files, here the weights, with their sha256 and size);
- ``HEAD``/``GET /<id>/resolve/<rev>/<file>``: ``X-Repo-Commit``, ``ETag`` (an LFS file's
  sha256, else its git blob id), ``X-Linked-Etag`` and ``X-Linked-Size`` for LFS files,
  ``Content-Length``;
- errors as the hub sends them: ``X-Error-Code`` ``RepoNotFound`` (404), ``RevisionNotFound``
  (404), ``EntryNotFound`` (404), ``GatedRepo`` (401 without the repo's token).

Repos are made by the test (``add_revision``: files as bytes or paths); every request is counted
(``requests``), so a test can show that a build sends none. ``corrupt`` serves changed bytes
under a file's announced hash, as a damaged mirror or a truncated blob would.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Mapping
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".onnx")
_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_INFO = re.compile(rf"^/api/models/{_REPO}/revision/(?P<rev>[^/]+)$")
_TREE = re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)$")
_RESOLVE = re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha → file → bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag → commit sha
    token: str | None = None  # gated: files need "Authorization: Bearer <token>"
    corrupted: dict[str, bytes] = field(default_factory=dict)  # file → bytes served instead

    def commit(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


class HubStandIn:
    """``with HubStandIn() as hub: ... hub.url``: a thread serving on 127.0.0.1, a free port."""

    def __init__(self):
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[str] = []  # "METHOD path", in arrival order
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------ what the test sets up
    def add_revision(self, repo_id: str, files: Mapping[str, bytes | Path], refs: tuple[str, ...] = ("main",),
                     token: str | None = None) -> str:
        """A commit of ``files`` (its sha, 40 hex, from the content); ``refs`` point at it."""
        contents = {name: value.read_bytes() if isinstance(value, Path) else bytes(value)
                    for name, value in files.items()}
        digest = hashlib.sha1()
        for name in sorted(contents):
            digest.update(name.encode() + b"\0" + hashlib.sha256(contents[name]).digest())
        sha = digest.hexdigest()
        repo = self.repos.setdefault(repo_id, HubRepo())
        repo.commits[sha] = contents
        repo.refs.update({ref: sha for ref in refs})
        if token is not None:
            repo.token = token
        return sha

    def corrupt(self, repo_id: str, filename: str) -> None:
        """Serve ``filename`` with one byte changed, under the hash and size the hub announces."""
        data = next(files[filename] for files in self.repos[repo_id].commits.values() if filename in files)
        self.repos[repo_id].corrupted[filename] = bytes([data[0] ^ 0xFF]) + data[1:]

    def count(self, prefix: str = "") -> int:
        with self._lock:
            return sum(1 for request in self.requests if request.split(" ", 1)[1].startswith(prefix))

    # ----------------------------------------------------------------------------- the server
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "HubStandIn":
        standin = self

        class Handler(_Handler):
            hub = standin

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="hf-hub-standin", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append(f"{method} {path}")


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandIn

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._handle(body=True)

    def do_HEAD(self) -> None:
        self._handle(body=False)

    def _handle(self, body: bool) -> None:
        path = urlsplit(self.path).path
        self.hub.record(self.command, path)
        for pattern, answer in ((_INFO, self._info), (_TREE, self._tree), (_RESOLVE, self._resolve)):
            match = pattern.match(path)
            if match:
                repo = self.hub.repos.get(unquote(match["repo"]))
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found", body)
                commit = repo.commit(unquote(match["rev"]))
                if commit is None:
                    return self._error(404, "RevisionNotFound", "Invalid rev id", body)
                return answer(match, repo, commit, body)
        self._error(404, None, "Not found", body)

    def _info(self, match, repo: HubRepo, commit: str, body: bool) -> None:
        files = repo.commits[commit]
        self._json({"id": unquote(match["repo"]), "sha": commit, "private": False, "gated": bool(repo.token),
                    "siblings": [{"rfilename": name} for name in sorted(files)]}, body)

    def _tree(self, match, repo: HubRepo, commit: str, body: bool) -> None:
        entries, folders = [], set()
        for name, data in sorted(repo.commits[commit].items()):
            parts = name.split("/")[:-1]
            folders.update("/".join(parts[:i + 1]) for i in range(len(parts)))
            entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        entries += [{"type": "directory", "path": folder, "size": 0, "oid": git_blob_id(folder.encode())}
                    for folder in sorted(folders)]
        self._json(entries, body, commit)

    def _resolve(self, match, repo: HubRepo, commit: str, body: bool) -> None:
        if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(401, "GatedRepo", "Access to this model is restricted", body, commit)
        filename = unquote(match["file"])
        data = repo.commits[commit].get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", "Entry not found", body, commit)
        lfs = filename.endswith(LFS_SUFFIXES)
        etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)
        served = repo.corrupted.get(filename, data)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(served)))
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", commit)
        if lfs:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(served)

    def _json(self, value, body: bool, commit: str | None = None) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str, body: bool, commit: str | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if body:
            self.wfile.write(data)


# What a test's process must not inherit: a real cache location, offline mode, a token.
HUB_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN")


@contextlib.contextmanager
def hub_environment(monkeypatch, hf_home: Path):
    """A ``HubStandIn`` that huggingface_hub reaches (``HF_ENDPOINT``), with an own cache at ``hf_home``."""
    with HubStandIn() as standin:
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        monkeypatch.setenv("HF_HOME", str(hf_home))
        for name in HUB_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        yield standin

