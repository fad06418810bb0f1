"""A minimal Hub-compatible HTTP server on 127.0.0.1 for upload and download tests (no maintained local Hub
server with a pip-installable backend was found: hf-local-hub's wheel ships no server binary).

It implements the endpoints huggingface_hub's HfApi and hf_hub_download use, with the Hub's error codes:
whoami, repo creation, branches, repo info, the tree listing, preupload (regular or LFS by file name and
size, with the remote oid that makes an unchanged file a no-op), the LFS batch API with the basic transfer
(an object already stored gets no upload action, as on the Hub), the PUT of an LFS object (refused unless
its bytes hash to its oid), commits of regular and LFS files, and file downloads (`resolve`, HEAD and GET
with byte ranges). No Xet: the client uses the LFS path with HF_HUB_DISABLE_XET set.

A test reads back exactly what the real client sent (`repos`, `lfs`), what it asked for (`requests`), and
can hook a stored LFS object (`on_lfs_stored`, e.g. to kill an upload midway) or cut a download short once
(`cut_once`)."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
LFS_MIN_BYTES = 10 * 1024 * 1024
INVALID_TOKEN = "Invalid credentials in Authorization header"


def is_lfs(path: str, size: int) -> bool:
    """As the Hub's default .gitattributes do: weight files, and anything large, go to LFS."""
    return size > 0 and (path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES)


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def pointer(data: bytes) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n".encode()


class Hub:
    def __init__(self, token: str = "hf_test_token", user: str = "user"):
        self.token, self.user = token, user
        self.tokens = {token: user}  # token -> user name
        self.read_only: set[str] = set()  # tokens whoami says are read-only
        # repo_id -> {"private", "gated": set of users allowed or None, "branches": {name: {path: bytes}}, "heads": {name: oid}}
        self.repos: dict[str, dict] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 -> content, stored by a complete PUT
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.lfs_puts: list[str] = []  # oids stored, in order
        self.commits: list[tuple[str, list[str]]] = []  # (repo_id, paths) of every commit
        self.on_lfs_stored: Callable[[str], None] | None = None
        self.cut_once: set[str] = set()  # file paths whose next GET is cut off halfway
        self.ranges: list[tuple[str, str]] = []  # (file path, Range header) of every ranged GET
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                hub._handle(self, "GET")

            def do_HEAD(self):
                hub._handle(self, "HEAD")

            def do_POST(self):
                hub._handle(self, "POST")

            def do_PUT(self):
                hub._handle(self, "PUT")

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # a client killed midway (the point of some tests) resets its connections

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # -- test helpers ----------------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes], *, private: bool = False, gated: set[str] | None = None,
                 branch: str = "main") -> None:
        """A repo as if pushed: LFS files' content stored by oid. `gated`: the users granted access."""
        repo = self.repos.setdefault(repo_id, {"private": private, "gated": gated, "branches": {"main": {}}, "heads": {}})
        repo["branches"].setdefault(branch, {}).update(files)
        for path, data in files.items():
            if is_lfs(path, len(data)):
                self.lfs[hashlib.sha256(data).hexdigest()] = data
        self._advance(repo, branch, list(files))

    def fetched(self, repo_id: str) -> list[str]:
        """The file paths downloaded (GET) from `repo_id`, in order."""
        prefix = f"/{repo_id}/resolve/"
        return [unquote(p[len(prefix):]).split("/", 1)[1] for m, p in self.requests if m == "GET" and p.startswith(prefix)]

    def _advance(self, repo: dict, branch: str, paths: list[str]) -> str:
        files = repo["branches"][branch]
        state = json.dumps([repo["heads"].get(branch), sorted(paths), sorted((p, git_sha1(d)) for p, d in files.items())])
        repo["heads"][branch] = hashlib.sha1(state.encode()).hexdigest()
        return repo["heads"][branch]

    # -- HTTP ------------------------------------------------------------------------------------------
    def _handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(req.path)
        with self._lock:
            self.requests.append((method, url.path))
        body = self._body(req) if method in ("POST", "PUT") else b""
        if body is None:
            return  # the client went away midway (a killed upload): nothing is stored
        auth = req.headers.get("Authorization")
        user = None
        if auth is not None:
            user = self.tokens.get(auth.removeprefix("Bearer "))
            if user is None:
                return self._send(req, 401, {"error": INVALID_TOKEN}, {"X-Error-Message": INVALID_TOKEN})
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            self._route(req, method, parts, query, body, user)
        except ConnectionError:
            pass

    def _route(self, req, method, parts, query, body, user):
        if parts[:2] == ["api", "whoami-v2"]:
            if user is None:
                return self._send(req, 401, {"error": "Unauthorized"})
            role = "read" if req.headers["Authorization"].removeprefix("Bearer ") in self.read_only else "write"
            return self._send(req, 200, {"type": "user", "name": user, "auth": {"accessToken": {"role": role}}})
        if parts[:2] == ["api", "validate-yaml"]:  # model-card metadata check
            return self._send(req, 200, {"errors": [], "warnings": []})
        if parts[:3] == ["api", "repos", "create"] and method == "POST":
            if user is None:
                return self._send(req, 401, {"error": "Unauthorized"})
            data = json.loads(body)
            repo_id = data["name"] if "/" in data["name"] else f"{data.get('organization') or user}/{data['name']}"
            if repo_id in self.repos:
                return self._send(req, 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"})
            private = bool(data.get("private")) or data.get("visibility") == "private"
            self.repos[repo_id] = {"private": private, "gated": None, "branches": {"main": {}}, "heads": {}}
            return self._send(req, 200, {"url": f"{self.url}/{repo_id}", "name": repo_id})
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api_models(req, method, parts, query, body, user)
        if method == "PUT" and parts[0] == "lfs-objects" and len(parts) == 2:
            return self._lfs_put(req, parts[1], body)
        if len(parts) >= 3 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]:
            return self._lfs_batch(req, f"{parts[0]}/{parts[1][:-4]}", body, user)
        if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve(req, method, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), user)
        return self._send(req, 404, {"error": f"not implemented: {method} {req.path}"})

    def _readable(self, req, repo_id: str, user: str | None, files: bool = False):
        """The repo, or None after sending the Hub's answer for one that is absent, private or gated."""
        repo = self.repos.get(repo_id)
        if repo is None or (repo["private"] and user != repo_id.split("/")[0]):
            self._send(req, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            return None
        if files and repo["gated"] is not None and user not in repo["gated"]:
            message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it."
            self._send(req, 403 if user else 401, {"error": message}, {"X-Error-Code": "GatedRepo", "X-Error-Message": message})
            return None
        return repo

    def _branch(self, req, repo, rev: str):
        if rev not in repo["branches"]:
            for name, head in repo["heads"].items():  # a commit id: the branch it heads
                if head == rev:
                    return name
            self._send(req, 404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"})
            return None
        return rev

    def _api_models(self, req, method, parts, query, body, user):
        repo_id = "/".join(parts[2:4])
        action = parts[4] if len(parts) > 4 else None
        if method in ("GET", "HEAD") and action in (None, "revision", "tree"):
            repo = self._readable(req, repo_id, user)
            if repo is None:
                return
            branch = self._branch(req, repo, parts[5] if len(parts) > 5 else "main")
            if branch is None:
                return
            files = repo["branches"][branch]
            if action == "tree":
                under = "/".join(parts[6:])
                return self._send(req, 200, [self._entry(p, d) for p, d in sorted(files.items())
                                              if not under or p.startswith(under + "/")])
            return self._send(req, 200, {
                "id": repo_id, "sha": repo["heads"].get(branch) or "0" * 40, "private": repo["private"],
                "gated": "manual" if repo["gated"] is not None else False,
                "siblings": [{"rfilename": p} for p in sorted(files)],
            })
        if method != "POST" or action is None:
            return self._send(req, 404, {"error": f"not implemented: {method} {req.path}"})
        repo = self.repos.get(repo_id)
        if user is None or repo is None or user != repo_id.split("/")[0]:
            return self._send(req, 404 if repo is None else 403, {"error": "Repository not found or no write access"},
                              {"X-Error-Code": "RepoNotFound"} if repo is None else {})
        rev = "/".join(parts[5:]) or "main"
        if action == "branch":
            repo["branches"].setdefault(rev, dict(repo["branches"]["main"]))
            repo["heads"].setdefault(rev, repo["heads"].get("main") or "0" * 40)
            return self._send(req, 200, {})
        files = repo["branches"].get(rev)
        if files is None:
            return self._send(req, 404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"})
        if action == "preupload":
            answer = []
            for f in json.loads(body)["files"]:
                lfs = is_lfs(f["path"], f["size"])
                old = files.get(f["path"])
                oid = None if old is None else (hashlib.sha256(old).hexdigest() if is_lfs(f["path"], len(old)) else git_sha1(old))
                answer.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
            return self._send(req, 200, {"files": answer})
        if action == "commit":
            changed = {}
            for line in body.decode().splitlines():
                item = json.loads(line)
                value = item["value"]
                if item["key"] == "file":
                    changed[value["path"]] = base64.b64decode(value["content"])
                elif item["key"] == "lfsFile":
                    if value["oid"] not in self.lfs:
                        return self._send(req, 400, {"error": f"LFS object {value['oid']} for {value['path']} was not uploaded"})
                    changed[value["path"]] = self.lfs[value["oid"]]
            files.update(changed)
            oid = self._advance(repo, rev, list(changed))
            self.commits.append((repo_id, sorted(changed)))
            return self._send(req, 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid, "success": True})
        return self._send(req, 404, {"error": f"not implemented: {method} {req.path}"})

    def _entry(self, path: str, data: bytes) -> dict:
        entry = {"type": "file", "path": path, "size": len(data)}
        if is_lfs(path, len(data)):
            ptr = pointer(data)
            entry |= {"oid": git_sha1(ptr), "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(ptr)}}
        else:
            entry["oid"] = git_sha1(data)
        return entry

    def _lfs_batch(self, req, repo_id, body, user):
        repo = self.repos.get(repo_id)
        if user is None or repo is None or user != repo_id.split("/")[0]:
            return self._send(req, 403, {"message": "no write access"})
        objects = []
        for obj in json.loads(body)["objects"]:
            if obj["oid"] in self.lfs:
                objects.append({"oid": obj["oid"], "size": obj["size"]})  # already stored: nothing to send
            else:
                objects.append({"oid": obj["oid"], "size": obj["size"],
                                "actions": {"upload": {"href": f"{self.url}/lfs-objects/{obj['oid']}"}}})
        return self._send(req, 200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def _lfs_put(self, req, oid, body):
        if hashlib.sha256(body).hexdigest() != oid:
            return self._send(req, 400, {"error": "content does not match its oid"})
        with self._lock:
            self.lfs[oid] = body
            self.lfs_puts.append(oid)
        if self.on_lfs_stored:
            self.on_lfs_stored(oid)
        return self._send(req, 200, {})

    def _resolve(self, req, method, repo_id, rev, path, user):
        repo = self._readable(req, repo_id, user, files=True)
        if repo is None:
            return
        branch = self._branch(req, repo, rev)
        if branch is None:
            return
        data = repo["branches"][branch].get(path)
        if data is None:
            return self._send(req, 404, {"error": f"{path} not found"}, {"X-Error-Code": "EntryNotFound"})
        headers = {"X-Repo-Commit": repo["heads"][branch], "Accept-Ranges": "bytes"}
        if is_lfs(path, len(data)):
            headers |= {"X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Linked-Size": str(len(data)),
                        "ETag": f'"{git_sha1(pointer(data))}"'}
        else:
            headers["ETag"] = f'"{git_sha1(data)}"'
        start, status = 0, 200
        ranged = req.headers.get("Range")
        if ranged and method == "GET" and ranged.startswith("bytes="):
            self.ranges.append((path, ranged))
            start = int(ranged[6:].split("-")[0])
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        payload = data[start:]
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        if method == "HEAD":
            return
        if path in self.cut_once and status == 200 and len(payload) > 1:
            self.cut_once.discard(path)
            req.wfile.write(payload[: len(payload) // 2])
            req.wfile.flush()
            req.close_connection = True
            return
        req.wfile.write(payload)

    # -- plumbing --------------------------------------------------------------------------------------
    @staticmethod
    def _body(req) -> bytes | None:
        try:
            if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    line = req.rfile.readline()
                    if not line:
                        return None
                    size = int(line.split(b";")[0].strip(), 16)
                    if size == 0:
                        req.rfile.readline()
                        return bytes(out)
                    chunk = req.rfile.read(size + 2)
                    if len(chunk) < size + 2:
                        return None
                    out += chunk[:size]
            length = int(req.headers.get("Content-Length", 0) or 0)
            data = req.rfile.read(length)
            return data if len(data) == length else None
        except (ConnectionError, ValueError):
            return None

    @staticmethod
    def _send(req, code: int, body, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        req.send_response(code)
        req.send_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)


def isolate(monkeypatch, home) -> None:
    """A Hugging Face home of the test's own (no saved login, an empty cache) and no Xet (this server has
    none), for this process and the subprocesses it starts; no token in the environment."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
