"""A minimal Hugging Face hub on loopback, so the real `huggingface_hub` client code path runs.

It serves model repositories (folders on disk) with the endpoints huggingface_hub 2.x calls:

- `GET /api/models?search=…`                       listing (HfApi.list_models)
- `GET /api/models/{repo}[/revision/{rev}]`        model info with siblings (model_info,
                                                     snapshot_download's repo listing)
- `GET /api/models/{repo}/tree/{rev}?recursive=true`  the file list snapshot_download uses
- `HEAD|GET /{repo}/resolve/{rev}/{file}`          file metadata and content, with the headers
                                                     the client reads: ETag, X-Repo-Commit,
                                                     Content-Length, X-Linked-Etag/-Size (LFS)
                                                     and Range for resumed downloads

Every request is recorded in `requests` so tests can see what the client asked for.
`delay_per_chunk` slows file bodies down so tests can watch progress and cancel.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


class Repo:
    def __init__(self, repo_id: str, folder: Path, *, tags: list[str] | None = None):
        self.repo_id = repo_id
        self.folder = folder
        self.tags = tags or ["mlx", "safetensors", "text-generation"]
        files = sorted(p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts)
        digest = hashlib.sha1()
        self.files: dict[str, Path] = {}
        for p in files:
            rel = p.relative_to(folder).as_posix()
            self.files[rel] = p
            digest.update(rel.encode() + p.read_bytes())
        self.sha = digest.hexdigest()  # the "commit" of this repo

    def etag(self, name: str) -> str:
        data = self.files[name].read_bytes()
        if name.endswith(LFS_SUFFIXES):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def tree(self) -> list[dict]:
        out = []
        for name, path in self.files.items():
            size = path.stat().st_size
            entry = {"type": "file", "oid": hashlib.sha1(path.read_bytes()).hexdigest(), "size": size, "path": name}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": self.etag(name), "size": size, "pointerSize": 134}
            out.append(entry)
        return out

    def info(self, files_metadata: bool) -> dict:
        siblings = []
        for name, path in self.files.items():
            sib: dict = {"rfilename": name}
            if files_metadata:
                size = path.stat().st_size
                sib["size"] = size
                sib["blobId"] = hashlib.sha1(path.read_bytes()).hexdigest()
                if name.endswith(LFS_SUFFIXES):
                    sib["lfs"] = {"sha256": self.etag(name), "size": size, "pointerSize": 134}
            siblings.append(sib)
        return {
            "_id": self.sha[:24],
            "id": self.repo_id,
            "modelId": self.repo_id,
            "author": self.repo_id.split("/")[0],
            "sha": self.sha,
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 42,
            "likes": 7,
            "tags": self.tags,
            "pipeline_tag": "text-generation",
            "library_name": "mlx",
            "siblings": siblings,
        }


class FakeHub:
    def __init__(self, delay_per_chunk: float = 0.0, chunk_size: int = 64 * 1024):
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.delay_per_chunk = delay_per_chunk
        self.chunk_size = chunk_size
        self._server: ThreadingHTTPServer | None = None

    def add_repo(self, repo_id: str, folder: Path, **kw) -> Repo:
        repo = Repo(repo_id, folder, **kw)
        self.repos[repo_id] = repo
        return repo

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output quiet
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # ----- routing ------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        self.requests.append((h.command, h.path))
        query = parse_qs(url.query)
        if path == "/api/models":
            return self._search(h, query)
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            if "/tree/" in rest:
                repo_id, _rev = rest.split("/tree/", 1)
                repo = self.repos.get(repo_id)
                if repo is None:
                    return self._not_found(h, "Repository not found")
                return self._json(h, repo.tree())
            if "/revision/" in rest:
                repo_id, _rev = rest.split("/revision/", 1)
            else:
                repo_id = rest
            repo = self.repos.get(repo_id)
            if repo is None:
                return self._not_found(h, "Repository not found")
            files_metadata = "blobs" in query and query["blobs"][0].lower() == "true"
            return self._json(h, repo.info(files_metadata))
        if "/resolve/" in path:
            repo_id, rest = path.lstrip("/").split("/resolve/", 1)
            _rev, _, name = rest.partition("/")
            repo = self.repos.get(repo_id)
            if repo is None:
                return self._not_found(h, "Repository not found")
            if name not in repo.files:
                return self._not_found(h, "Entry not found", code="EntryNotFound")
            return self._file(h, repo, name, head)
        return self._not_found(h, "Not found")

    def _search(self, h: BaseHTTPRequestHandler, query: dict) -> None:
        term = (query.get("search") or [""])[0].lower()
        limit = int((query.get("limit") or ["100"])[0])
        wanted_tags = query.get("filter") or []
        out = []
        for repo in self.repos.values():
            if term and term not in repo.repo_id.lower():
                continue
            if any(t not in repo.tags for t in wanted_tags):
                continue
            info = repo.info(False)
            info.pop("siblings")
            out.append(info)
        self._json(h, out[:limit])

    def _json(self, h: BaseHTTPRequestHandler, body: object, status: int = 200, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _not_found(self, h: BaseHTTPRequestHandler, message: str, code: str = "RepoNotFound") -> None:
        self._json(h, {"error": message}, 404, {"X-Error-Code": code, "X-Error-Message": message})

    def _file(self, h: BaseHTTPRequestHandler, repo: Repo, name: str, head: bool) -> None:
        data = repo.files[name].read_bytes()
        etag = repo.etag(name)
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-", 1)[0] or 0)
        body = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("ETag", f'"{etag}"')
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("Accept-Ranges", "bytes")
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if name.endswith(LFS_SUFFIXES):
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
        h.end_headers()
        if head:
            return
        try:
            for i in range(0, len(body), self.chunk_size):
                h.wfile.write(body[i:i + self.chunk_size])
                if self.delay_per_chunk:
                    time.sleep(self.delay_per_chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
