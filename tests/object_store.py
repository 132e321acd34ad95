"""A local S3 server for tests and benchmarks: moto's server on 127.0.0.1, with a proxy in front of it
when a test needs a slower or a lesser service.

The proxy forwards every request to moto, after `delay` seconds (a remote bucket's round trip), and with
`drop_conditions` it strips the conditional-write headers (`If-None-Match`, `If-Match`), as a service
without conditional writes ignores them. Each test gets a bucket of its own (`S3Server.bucket`); the
`AWS_*` variables that point obstore (and any subprocess) at the server are `S3Server.environment()`.

moto runs in a child process: its server is a Flask app, and with Flask imported here vLLM's engine
start (which scans every module's attributes while it registers its kernels) meets `flask.request`,
whose attribute lookup raises outside a request, and fails the vLLM tests that run after this one.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_CONDITIONS = ("if-none-match", "if-match")
# The child: moto's threaded server on a free port; prints "host port", serves until its stdin closes.
_SERVE = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(*server.get_host_and_port(), flush=True)
sys.stdin.read()
server.stop()
"""
# Hop-by-hop headers a proxy does not pass on.
_HOP = ("connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade")


class S3Server:
    """moto's S3 server, and optionally a proxy in front of it (see the module's docstring)."""

    def __init__(self, *, delay: float = 0.0, drop_conditions: bool = False) -> None:
        self._moto = subprocess.Popen(
            [sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._moto.stdout is not None
        started = self._moto.stdout.readline().split()
        if len(started) != 2:
            raise RuntimeError("moto's S3 server did not start; its extra comes with pip install -e '.[dev]'")
        host, port_text = started
        port = int(port_text)
        self.moto_endpoint = f"http://{host}:{port}"
        self._proxy: ThreadingHTTPServer | None = None
        self.endpoint = self.moto_endpoint
        self.requests = 0  # requests the proxy forwarded
        if delay or drop_conditions:
            self._proxy = _proxy(self, host, port, delay=delay, drop_conditions=drop_conditions)
            self.endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"
            threading.Thread(target=self._proxy.serve_forever, daemon=True).start()

    def environment(self) -> dict[str, str]:
        """The variables that point an S3 client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "mopd-test",
            "AWS_SECRET_ACCESS_KEY": "mopd-test",
            "AWS_REGION": "us-east-1",
        }

    def bucket(self, name: str | None = None) -> str:
        """Creates a bucket (a fresh name by default) and returns its `s3://` URL."""
        import boto3

        name = name or f"mopd-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.moto_endpoint,
            aws_access_key_id="mopd-test",
            aws_secret_access_key="mopd-test",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy.server_close()
        assert self._moto.stdin is not None
        self._moto.stdin.close()
        try:
            self._moto.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._moto.kill()
            self._moto.wait()


def _proxy(
    server: S3Server, host: str, port: int, *, delay: float, drop_conditions: bool
) -> ThreadingHTTPServer:
    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _forward(self) -> None:
            time.sleep(delay)
            server.requests += 1
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in _HOP and not (drop_conditions and k.lower() in _CONDITIONS)
            }
            upstream = http.client.HTTPConnection(host, port, timeout=60)
            try:
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self.send_response(response.status, response.reason)
                for k, v in response.getheaders():
                    if k.lower() not in _HOP and (k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            finally:
                upstream.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    proxy.daemon_threads = True
    return proxy
