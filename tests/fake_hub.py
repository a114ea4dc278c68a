"""A fake Hugging Face Hub on 127.0.0.1 for the -hf tests: just the endpoints huggingface_hub calls
for HfApi.list_repo_files / model_info and hf_hub_download (read in huggingface_hub's hf_api.py and
file_download.py):

  GET  /api/models/{user}/{repo}/tree/{revision}?recursive=...  -> [{type, oid, size, path}, ...]
  GET  /api/models/{user}/{repo}[/revision/{revision}]          -> {id, sha, siblings: [{rfilename}]}
  HEAD /{user}/{repo}/resolve/{revision}/{path}                 -> X-Repo-Commit, ETag, Content-Length
  GET  /{user}/{repo}/resolve/{revision}/{path}                 -> the bytes; honours "Range: bytes=N-"

Unknown repositories and files answer 404 with the X-Error-Code header the real Hub sends. A file
named in `drop_once` is cut off the first time it is fetched: the headers announce its full length,
half the bytes are sent and the connection is closed, as a network failure would. Every request is
recorded in `log` as (method, path, Range header or None). Serves from a thread; stop() shuts it down.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/tree/([^/]+)(?:/(.*))?|/revision/([^/]+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class FakeHub:
    def __init__(self, repos: dict):
        """repos: {"user/repo": {"path/in/repo": bytes, ...}, ...}."""
        self.repos = repos
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.drop_once: set = set()
        self.log: list = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def requests_for(self, path_in_repo: str, method: str = "GET") -> list:
        return [e for e in self.log if e[0] == method and e[1].endswith("/" + path_in_repo)]

    # ------------------------------------------------------------------------------------------

    def _send_json(self, h, obj, status=200):
        body = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _not_found(self, h, code: str, head: bool):
        body = b'{"error": "not found"}'
        h.send_response(404)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", "0" if head else str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _handle(self, h, head: bool):
        url = urlparse(h.path)
        path = unquote(url.path)
        with self._lock:
            self.log.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        m = _API.match(path)
        if m and not head:
            repo = m.group(1)
            if repo not in self.repos:
                return self._not_found(h, "RepoNotFound", head)
            files = self.repos[repo]
            if m.group(2) is not None:  # tree listing (one page: no Link header)
                prefix = (m.group(3) or "").strip("/")
                entries = [
                    {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
                    for name, data in sorted(files.items())
                    if not prefix or name.startswith(prefix + "/")
                ]
                return self._send_json(h, entries)
            return self._send_json(
                h,
                {
                    "id": repo,
                    "modelId": repo,
                    "sha": self.commits[repo],
                    "private": False,
                    "siblings": [{"rfilename": name} for name in sorted(files)],
                },
            )
        m = _RESOLVE.match(path)
        if not m:
            return self._not_found(h, "EntryNotFound", head)
        repo, _revision, name = m.groups()
        if repo not in self.repos:
            return self._not_found(h, "RepoNotFound", head)
        data = self.repos[repo].get(name)
        if data is None:
            return self._not_found(h, "EntryNotFound", head)
        etag = '"' + hashlib.sha256(data).hexdigest() + '"'
        start = 0
        rng = h.headers.get("Range")
        if rng and not head:
            found = re.match(r"bytes=(\d+)-$", rng.strip())
            start = int(found.group(1)) if found else 0
        body = data[start:]
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", self.commits[repo])
        h.send_header("ETag", etag)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        if not head and name in self.drop_once:
            self.drop_once.discard(name)
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # SHUT_RDWR: the client sees the body end early
            return
        h.end_headers()
        if not head:
            h.wfile.write(body)
