"""A small stand-in for the Hugging Face Hub, speaking the HTTP protocol huggingface_hub uses.

Standard library only, bound to 127.0.0.1, state in memory. It serves what ``upload_folder``,
``snapshot_download`` and ``hf_hub_download`` call with ``HF_HUB_DISABLE_XET=1`` (read from
huggingface_hub 2.4's ``hf_api.py``, ``_commit_api.py``, ``lfs.py``, ``file_download.py``):

- ``POST /api/repos/create``, ``POST /api/validate-yaml``
- ``POST /api/models/{repo}/preupload/{rev}`` (which files go by LFS)
- ``POST /{repo}.git/info/lfs/objects/batch``, ``PUT`` upload href, ``POST`` verify href
- ``POST /api/models/{repo}/commit/{rev}`` (NDJSON: header, file, lfsFile, deletedFile, deletedFolder)
- ``GET /api/models/{repo}[/revision/{rev}]``, ``GET /api/models/{repo}/tree/{rev}[/{path}]``
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}`` (ETag, X-Repo-Commit, X-Linked-Etag, X-Linked-Size)

Private repositories answer reads only to the configured token. ``fail(kind, n, status)``
makes the next ``n`` requests of a kind fail (retry tests); every request's method, path,
kind and headers are recorded (token tests).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")
LFS_MIN_SIZE = 100_000  # larger regular files go by LFS too, as a .gitattributes rule would send them
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.pt filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Entry:
    """One file of one commit: regular files keep their bytes, LFS files point into the LFS store."""

    size: int
    sha1: str  # git blob id (of the pointer file for LFS)
    lfs_oid: str | None = None
    data: bytes | None = None


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: list[tuple[str, dict[str, Entry]]] = field(default_factory=list)  # (oid, files), oldest first
    messages: list[str] = field(default_factory=list)  # commit summaries, oldest first

    def head(self) -> tuple[str, dict[str, Entry]]:
        return self.commits[-1]

    def at(self, revision: str) -> tuple[str, dict[str, Entry]] | None:
        if revision in ("main", "HEAD"):
            return self.head()
        return next((c for c in self.commits if c[0] == revision), None)


class HubState:
    def __init__(self, token: str | None) -> None:
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[dict[str, Any]] = []
        self.failures: dict[str, list[int]] = {}  # kind -> statuses still to answer
        self.lock = threading.Lock()

    def take_failure(self, kind: str) -> int | None:
        with self.lock:
            queue = self.failures.get(kind)
            return queue.pop(0) if queue else None

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Every file of a revision with its content (test helper)."""
        _, entries = self.repos[repo_id].at(revision)
        return {p: (e.data if e.lfs_oid is None else self.lfs[e.lfs_oid]) for p, e in entries.items()}


ROUTES = [  # (method, regex, kind)
    ("POST", r"^/api/repos/create$", "create"),
    ("POST", r"^/api/validate-yaml$", "validate-yaml"),
    ("POST", r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$", "preupload"),
    ("POST", r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$", "commit"),
    ("GET", r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>[^/]+)$", "revision"),
    ("GET", r"^/api/models/(?P<repo>[^/]+/[^/]+)$", "revision"),
    ("GET", r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$", "tree"),
    ("POST", r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$", "lfs-batch"),
    ("PUT", r"^/lfs-upload/(?P<oid>[0-9a-f]{64})$", "lfs-upload"),
    ("POST", r"^/lfs-verify/(?P<oid>[0-9a-f]{64})$", "lfs-verify"),
    ("HEAD", r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "resolve"),
    ("GET", r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "resolve"),
]


class Handler(BaseHTTPRequestHandler):
    server: "HubServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        return

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # -------------------------------------------------------------- plumbing

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        body = self._read_body()
        state = self.server.state
        for route_method, pattern, kind in ROUTES:
            match = re.match(pattern, path)
            if route_method == method and match:
                break
        else:
            kind, match = "unknown", None
        headers = {k.lower(): v for k, v in self.headers.items()}  # HTTP header names are case-insensitive
        state.requests.append({"method": method, "path": path, "kind": kind, "headers": headers})
        if match is None:
            return self._json(404, {"error": f"no route for {method} {path}"})
        status = state.take_failure(kind)
        if status is not None:
            return self._json(status, {"error": f"injected failure of {kind}"})
        handler = getattr(self, "_" + kind.replace("-", "_"))
        handler(match.groupdict(), body, parse_qs(url.query), method)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _authorized(self, repo: Repo) -> bool:
        token = self.server.state.token
        return not repo.private or token is None or self.headers.get("Authorization") == f"Bearer {token}"

    def _repo(self, repo_id: str, write: bool = False) -> Repo | None:
        """The repository if it exists and this request may see it (else answers 404/401 itself)."""
        repo = self.server.state.repos.get(repo_id)
        token = self.server.state.token
        if repo is None or not self._authorized(repo) or (write and token and
                                                         self.headers.get("Authorization") != f"Bearer {token}"):
            self._json(401 if repo is not None else 404, {"error": "Repository not found"},
                       {"X-Error-Code": "RepoNotFound"})
            return None
        return repo

    # -------------------------------------------------------------- endpoints

    def _create(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        payload = json.loads(body)
        repo_id = f"{payload['organization'] or 'user'}/{payload['name']}"
        state = self.server.state
        if state.token and self.headers.get("Authorization") != f"Bearer {state.token}":
            return self._json(401, {"error": "Invalid credentials in Authorization header"})
        url = f"{self.server.base_url}/{repo_id}"
        with state.lock:
            if repo_id in state.repos:
                return self._json(409, {"error": "You already created this model repo", "url": url})
            repo = Repo(repo_id, private=payload.get("visibility", "public") == "private")
            init = {".gitattributes": Entry(len(GITATTRIBUTES), git_blob_sha1(GITATTRIBUTES), data=GITATTRIBUTES)}
            repo.commits.append((_commit_oid(repo_id, 0), init))
            repo.messages.append("initial commit")
            state.repos[repo_id] = repo
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        import yaml

        content = json.loads(body)["content"]
        match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
        try:
            meta = yaml.safe_load(match.group(1)) if match else {}
        except yaml.YAMLError as exc:
            return self._json(400, {"errors": [{"message": f"invalid YAML: {exc}"}], "warnings": []})
        if not isinstance(meta, dict):
            return self._json(400, {"errors": [{"message": "metadata must be a mapping"}], "warnings": []})
        self._json(200, {"errors": [], "warnings": []})

    def _preupload(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        repo = self._repo(groups["repo"], write=True)
        if repo is None:
            return
        files = []
        for item in json.loads(body)["files"]:
            lfs = item["path"].endswith(LFS_SUFFIXES) or item["size"] >= LFS_MIN_SIZE
            files.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": None})
        self._json(200, {"files": files, "commitOid": repo.head()[0]})

    def _lfs_batch(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        if self._repo(groups["repo"], write=True) is None:
            return
        objects = []
        for obj in json.loads(body)["objects"]:
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self.server.state.lfs:
                entry["actions"] = {"upload": {"href": f"{self.server.base_url}/lfs-upload/{obj['oid']}"},
                                    "verify": {"href": f"{self.server.base_url}/lfs-verify/{obj['oid']}"}}
            objects.append(entry)
        self._json(200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"})

    def _lfs_upload(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        if hashlib.sha256(body).hexdigest() != groups["oid"]:
            return self._json(400, {"error": "content does not match its oid"})
        self.server.state.lfs[groups["oid"]] = body
        self._send(200, b"")

    def _lfs_verify(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        payload = json.loads(body)
        stored = self.server.state.lfs.get(groups["oid"])
        if stored is None or len(stored) != payload["size"]:
            return self._json(404, {"error": "object not uploaded"})
        self._json(200, {"success": True})

    def _commit(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        repo = self._repo(groups["repo"], write=True)
        if repo is None:
            return
        state = self.server.state
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            return self._json(400, {"error": "the first NDJSON line must be the header"})
        with state.lock:
            files = dict(repo.head()[1])
            for line in lines[1:]:
                value = line["value"]
                if line["key"] == "file":
                    data = base64.b64decode(value["content"])
                    files[value["path"]] = Entry(len(data), git_blob_sha1(data), data=data)
                elif line["key"] == "lfsFile":
                    if value["oid"] not in state.lfs:
                        return self._json(400, {"error": f"LFS object {value['oid']} was never uploaded"})
                    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{value['oid']}\nsize {value['size']}\n"
                    files[value["path"]] = Entry(value["size"], git_blob_sha1(pointer.encode()), lfs_oid=value["oid"])
                elif line["key"] == "deletedFile":
                    files.pop(value["path"], None)
                elif line["key"] == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: e for p, e in files.items() if not p.startswith(prefix)}
                else:
                    return self._json(400, {"error": f"unknown commit line {line['key']}"})
            oid = _commit_oid(repo.repo_id, len(repo.commits))
            repo.commits.append((oid, files))
            repo.messages.append(lines[0]["value"]["summary"])
        self._json(200, {"commitUrl": f"{self.server.base_url}/{repo.repo_id}/commit/{oid}", "commitOid": oid,
                         "success": True})

    def _at(self, repo: Repo, revision: str) -> tuple[str, dict[str, Entry]] | None:
        commit = repo.at(revision)
        if commit is None:
            self._json(404, {"error": f"Invalid rev id: {revision}"}, {"X-Error-Code": "RevisionNotFound"})
        return commit

    def _revision(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        repo = self._repo(groups["repo"])
        commit = repo and self._at(repo, groups.get("rev") or "main")
        if not commit:
            return
        oid, files = commit
        self._json(200, {"id": repo.repo_id, "modelId": repo.repo_id, "sha": oid, "private": repo.private,
                         "lastModified": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()), "tags": [],
                         "siblings": [{"rfilename": p, "size": e.size} for p, e in sorted(files.items())]})

    def _tree(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        repo = self._repo(groups["repo"])
        commit = repo and self._at(repo, groups["rev"])
        if not commit:
            return
        prefix = (groups.get("path") or "").strip("/")
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        items: dict[str, dict[str, Any]] = {}
        for path, entry in sorted(commit[1].items()):
            if prefix and not path.startswith(prefix + "/"):
                continue
            rest = path[len(prefix) + 1:] if prefix else path
            parts = rest.split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                folder = "/".join(([prefix] if prefix else []) + parts[:depth])
                if recursive or depth == 1:
                    items.setdefault(folder, {"type": "directory", "path": folder, "oid": git_blob_sha1(folder.encode())})
            if recursive or len(parts) == 1:
                item: dict[str, Any] = {"type": "file", "path": path, "size": entry.size, "oid": entry.sha1}
                if entry.lfs_oid:
                    item["lfs"] = {"oid": entry.lfs_oid, "size": entry.size, "pointerSize": 134}
                items[path] = item
        self._json(200, list(items.values()))

    def _resolve(self, groups: dict, body: bytes, query: dict, method: str) -> None:
        repo = self._repo(groups["repo"])
        commit = repo and self._at(repo, groups["rev"])
        if not commit:
            return
        oid, files = commit
        entry = files.get(groups["path"])
        if entry is None:
            return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": oid})
        data = entry.data if entry.lfs_oid is None else self.server.state.lfs[entry.lfs_oid]
        headers = {"X-Repo-Commit": oid, "ETag": f'"{entry.lfs_oid or entry.sha1}"',
                   "Content-Type": "application/octet-stream"}
        if entry.lfs_oid:
            headers.update({"X-Linked-Etag": f'"{entry.lfs_oid}"', "X-Linked-Size": str(entry.size)})
        self._send(200, data, headers, head=method == "HEAD")


def _commit_oid(repo_id: str, index: int) -> str:
    return hashlib.sha1(f"{repo_id}@{index}@{time.time_ns()}".encode()).hexdigest()


class HubServer(ThreadingHTTPServer):
    """``with HubServer(token) as hub: ...`` serves on ``hub.base_url`` from a background thread."""

    daemon_threads = True

    def __init__(self, token: str | None = None) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.state = HubState(token)
        self.base_url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, name="hub-server", daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
        self.server_close()

    def fail(self, kind: str, times: int, status: int = 500) -> None:
        """Answer the next ``times`` requests of ``kind`` (a route kind, e.g. "commit") with ``status``."""
        with self.state.lock:
            self.state.failures.setdefault(kind, []).extend([status] * times)
