"""A minimal Hub-compatible HTTP server on 127.0.0.1 for upload tests (no maintained local Hub server with a
pip-installable backend was found: hf-local-hub's wheel ships no server binary). It implements the Hub
endpoints huggingface_hub's HfApi uses to create a repo, a branch and a regular (non-LFS) commit, and keeps
the committed files so a test can read back exactly what the real client sent."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Hub:
    def __init__(self, token: str = "hf_test_token"):
        self.token = token
        self.repos: dict[str, dict] = {}  # repo_id -> {"private": bool, "branches": {name: {path: bytes}}}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:2] == ["api", "validate-yaml"]:  # model-card metadata check
                    return self._send(200, {"errors": [], "warnings": []})
                if parts[:3] == ["api", "repos", "create"]:
                    req = json.loads(body)
                    repo_id = f"{req.get('organization') or 'user'}/{req['name']}" if "/" not in req["name"] else req["name"]
                    if repo_id in hub.repos:
                        return self._send(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
                    hub.repos[repo_id] = {"private": bool(req.get("private")) or req.get("visibility") == "private", "branches": {"main": {}}}
                    return self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                if parts[:2] == ["api", "models"] and len(parts) >= 6:
                    repo_id, action, rev = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
                    repo = hub.repos.get(repo_id)
                    if repo is None:
                        return self._send(404, {"error": "Repository not found"})
                    if action == "branch":
                        repo["branches"].setdefault(rev, dict(repo["branches"]["main"]))
                        return self._send(200, {})
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
                    if action == "commit":
                        files = repo["branches"].setdefault(rev, {})
                        for line in body.decode().splitlines():
                            item = json.loads(line)
                            if item["key"] == "file":
                                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                        return self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/1", "commitOid": "1" * 40, "success": True})
                return self._send(404, {"error": f"not implemented: {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
