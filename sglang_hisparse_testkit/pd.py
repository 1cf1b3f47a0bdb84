"""A PD pair on one machine for tests and the GPU scripts: a prefill instance, decode instances,
and a router between them, with a real KV transfer (mooncake over TCP on 127.0.0.1).

SGLang 0.5.17 starts mooncake with its P2P handshake (no metadata server) when the transfer
backend is ``mooncake_tcp`` (``MC_FORCE_TCP=1``); ``SGLANG_HOST_IP=127.0.0.1`` keeps it from
probing a route to a public address. The router is :mod:`sglang_hisparse.serving.pd_router` (standard
library; it gives each request its bootstrap fields and sends it to both instances at once).
One prefill instance can serve several decode instances: the bootstrap fields of a request name
the prefill instance, the router names the decode instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_hisparse.serving.pd_router import Router, serve
from sglang_hisparse.serving.launcher import Server, free_port, post_json

TRANSFER_BACKEND = "mooncake_tcp"
PD_ENV = {"SGLANG_HOST_IP": "127.0.0.1", "MC_TCP_ENABLE_CONNECTION_POOL": "true"}
"""Environment of both instances: mooncake's TCP transport on the loopback address."""


def prefill_args(bootstrap_port: int, backend: str = TRANSFER_BACKEND) -> list[str]:
    """Server flags of a prefill instance (no HiSparse there)."""
    return ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", backend,
            "--disaggregation-bootstrap-port", str(bootstrap_port)]


def decode_args(backend: str = TRANSFER_BACKEND) -> list[str]:
    """Server flags of a decode instance (HiSparse or not: ``--enable-hisparse`` comes apart)."""
    return ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", backend]


@dataclass
class RoutedPair:
    """A router in this process in front of ``prefill`` and ``decode`` (both running).

    ``generate`` posts through the router; ``abort`` aborts a request (by ``rid``) on both
    instances, which is what a client's disconnect does in a PD deployment. ``close`` stops the
    router (the instances are the caller's)."""

    prefill: Server
    decode: Server
    bootstrap_port: int
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self._router = serve(Router(self.prefill.url, self.decode.url, self.bootstrap_port, "127.0.0.1"),
                             "127.0.0.1", self.port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generate(self, input_ids: Any, max_new_tokens: int, timeout: float = 1800, rid: Optional[Any] = None,
                 **sampling: Any) -> Any:
        """POST /generate through the router (greedy, ``ignore_eos``; a list of prompts or one)."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **sampling}
        body: dict = {"input_ids": input_ids, "sampling_params": params}
        if rid is not None:
            body["rid"] = rid
        return post_json(f"{self.url}/generate", body, timeout)

    def abort(self, rid: str) -> None:
        for server in (self.decode, self.prefill):
            post_json(f"{server.url}/abort_request", {"rid": rid}, 30)

    def close(self) -> None:
        self._router.shutdown()
        self._router.server_close()


def unpaired_request(input_ids: list[int], max_new_tokens: int, *, bootstrap_host: Optional[str] = None,
                     bootstrap_port: Optional[int] = None, bootstrap_room: Optional[int] = None) -> dict:
    """A /generate body for a decode instance directly (no router): what a misdirected client
    sends (no bootstrap fields), or one half of a pair whose other half is never sent."""
    body: dict = {"input_ids": input_ids,
                  "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    for name, value in (("bootstrap_host", bootstrap_host), ("bootstrap_port", bootstrap_port),
                        ("bootstrap_room", bootstrap_room)):
        if value is not None:
            body[name] = value
    return body
