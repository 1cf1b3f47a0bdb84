"""A small PD router: one /generate in, the same request to the prefill and the decode instance.

    python -m sglang_hisparse.serving.pd_router --prefill http://P:30000 --bootstrap-port 8998 \
        --decode http://D:30001 --port 8000

SGLang's PD protocol pairs the two halves of a request by three fields that both instances
receive: ``bootstrap_host`` and ``bootstrap_port`` (where the prefill instance's bootstrap server
listens) and ``bootstrap_room`` (a random id per request; a list for a batched request). The
router adds them, posts the request to both instances at once, and answers with the decode
instance's response (status, body; streamed responses are relayed as they come). The prefill
instance's answer is read and dropped; a prefill error is logged. ``GET /health`` is healthy when
both instances are. Standard library only; meant for tests and small deployments (SGLang's own
``sglang-router`` is the production choice).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import urlparse

logger = logging.getLogger(__name__)


def with_bootstrap(body: dict, host: str, port: int, rng: random.Random) -> dict:
    """The request both instances receive: ``body`` plus the bootstrap fields (one room per
    prompt of a batched request)."""
    prompts = body.get("input_ids", body.get("text"))
    batched = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], (list, str))
    count = len(prompts) if batched else 1
    rooms = [rng.getrandbits(63) for _ in range(count)]
    return {**body, "bootstrap_host": [host] * count if batched else host,
            "bootstrap_port": [port] * count if batched else port, "bootstrap_room": rooms if batched else rooms[0]}


class Router:
    def __init__(self, prefill: str, decode: str, bootstrap_port: int, bootstrap_host: Optional[str] = None,
                 timeout: float = 3600.0):
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.bootstrap_host = bootstrap_host or urlparse(prefill).hostname
        self.bootstrap_port = bootstrap_port
        self.timeout = timeout
        self._rng = random.Random()
        self._lock = threading.Lock()

    def paired(self, body: dict) -> dict:
        with self._lock:
            return with_bootstrap(body, self.bootstrap_host, self.bootstrap_port, self._rng)

    def post(self, url: str, body: dict):
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            return e  # carries the status and the body

    def drain_prefill(self, body: dict) -> None:
        response = self.post(f"{self.prefill}/generate", body)
        data = response.read()
        if response.status != 200:
            logger.error("prefill instance answered %s: %s", response.status, data[:500])

    def healthy(self) -> bool:
        for base in (self.prefill, self.decode):
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=10) as r:
                    if r.status != 200:
                        return False
            except (urllib.error.URLError, OSError):
                return False
        return True


def make_handler(router: Router):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/health":
                self._reply(404, b'{"error": "not found"}')
                return
            self._reply(200 if router.healthy() else 503, b"")

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/generate":
                self._reply(404, b'{"error": "not found"}')
                return
            body = router.paired(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
            prefill = threading.Thread(target=router.drain_prefill, args=(body,), daemon=True)
            prefill.start()
            response = router.post(f"{router.decode}/generate", body)
            if body.get("stream"):
                self._relay(response)
            else:
                self._reply(response.status, response.read())
            prefill.join()

        def _reply(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _relay(self, response: Any) -> None:
            self.send_response(response.status)
            self.send_header("Content-Type", response.headers.get("Content-Type", "text/event-stream"))
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for line in iter(response.readline, b""):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            logger.debug(format, *args)

    return Handler


def serve(router: Router, host: str, port: int) -> ThreadingHTTPServer:
    """A started server (its thread is a daemon); ``shutdown()`` stops it."""
    server = ThreadingHTTPServer((host, port), make_handler(router))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_hisparse.serving.pd_router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", required=True, help="the prefill instance's URL")
    p.add_argument("--decode", required=True, help="the decode instance's URL")
    p.add_argument("--bootstrap-port", type=int, default=8998, help="the prefill instance's bootstrap port")
    p.add_argument("--bootstrap-host", default=None, help="default: the prefill URL's host")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (requests are not authenticated)")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    router = Router(args.prefill, args.decode, args.bootstrap_port, args.bootstrap_host)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(router))
    logger.info("sglang-hisparse PD router on %s:%d: prefill %s (bootstrap %s:%d), decode %s", args.host, args.port,
                router.prefill, router.bootstrap_host, router.bootstrap_port, router.decode)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
