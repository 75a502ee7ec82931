"""An HTTP proxy on loopback in front of a real server (moto's S3, ``mlflow server``) that forwards
each request and its answer, headers included, except where the test says to answer otherwise: a
store that refuses a path for a while, or loses an answer on the way back.

Example:
    ```python
    refusing = True
    proxy = FaultProxy(s3.endpoint_url, refuse=lambda method, path: SLOW_DOWN if refusing else None)
    ...  # a job whose S3 endpoint is proxy.uri
    proxy.close()
    ```
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# (status, body, content type): an answer the proxy gives in place of the server's
Answer = tuple[int, bytes, str]

# S3's answer to a client it throttles: botocore and the job's uploader take it as one to retry.
SLOW_DOWN: Answer = (
    503,
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
    b"<Message>Please reduce your request rate.</Message></Error>",
    "application/xml",
)

# Hop-by-hop headers, and the length: the proxy sends its own.
_NOT_FORWARDED = {"connection", "transfer-encoding", "content-length", "keep-alive", "host"}


class FaultProxy:
    """Forwards every request to `upstream`. `refuse(method, path)`: an answer to give instead,
    the request never reaching the server (None: forward it); `after(method, path, answer)`: the
    answer its client gets once the server answered (None: the server's). `requests` counts
    requests by ``(method, path)``."""

    def __init__(
        self,
        upstream: str,
        refuse: Callable[[str, str], Answer | None] = lambda method, path: None,
        after: Callable[[str, str, Answer], Answer | None] = lambda method, path, answer: None,
    ):
        self.requests: dict[tuple[str, str], int] = {}
        target = urlsplit(upstream)
        proxy, lock = self, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # (keep-alive, as the clients expect of S3)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # (trailers)
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self):
                body, path = self._body(), urlsplit(self.path).path
                with lock:
                    key = (self.command, path)
                    proxy.requests[key] = proxy.requests.get(key, 0) + 1
                refused = refuse(self.command, path)
                if refused is not None:
                    return self._answer(*refused, headers=[])
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_FORWARDED}
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                kind = answer.getheader("Content-Type", "application/octet-stream")
                kept = [(k, v) for k, v in answer.getheaders() if k.lower() not in _NOT_FORWARDED]
                conn.close()
                changed = after(self.command, path, (answer.status, data, kind))
                if changed is not None:
                    return self._answer(*changed, headers=[])
                # (a HEAD's answer has no body, and says the length of the GET's)
                length = answer.getheader("Content-Length", "0") if self.command == "HEAD" else None
                self._answer(answer.status, data, kind, headers=kept, length=length)

            def _answer(self, status, data, kind, headers, length=None):
                self.send_response(status)
                for k, v in headers:
                    if k.lower() != "content-type":
                        self.send_header(k, v)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(length if length is not None else len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
