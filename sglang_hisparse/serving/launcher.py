"""Start, query and stop real SGLang servers for end-to-end tests and the demo.

A server is ``python -m sglang.launch_server`` in its own process group on 127.0.0.1, its output
in a log file; it is stopped by PID (SIGTERM to the group, SIGKILL after a grace period). On a
machine without a GPU the server runs SGLang's CPU engine with our CPU stand-in for
``sgl_kernel`` first on ``PYTHONPATH`` and the deterministic dummy weights.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

PACKAGE_DIR = Path(__file__).resolve().parents[1]
MODELS_DIR = PACKAGE_DIR / "models"
CPU_STAND_IN = PACKAGE_DIR / "cpu" / "stand_in"
IDLE_LINE = re.compile(r"sglang-hisparse idle(?P<c4> \(DeepSeek-V4 C4\))?: (?P<pools>.*) leak=(?P<leak>yes|no) "
                       r"selected=(?P<selected>\d+) misses=(?P<misses>\d+)"
                       r"(?:.*? steps=(?P<steps>\d+) host_us_per_step=(?P<host_us>[\d.]+))?"
                       r"(?:.*? resident=(?P<resident>\d+) admitted_resident=(?P<admitted>\d+) "
                       r"demotions=(?P<demotions>\d+) promotions=(?P<promotions>\d+))?"
                       r"(?: grown=(?P<grown>\d+) given_back=(?P<given_back>\d+))?")
"""Our idle report, DSA (``sglang-hisparse idle: ...``, stats.py) or DeepSeek-V4 C4
(``sglang-hisparse idle (DeepSeek-V4 C4): ...``, decode/c4_coordinator.py)."""
PREFIX_COUNTS = ("cached", "loaded", "lent", "shared", "evicted", "not_sent")
"""The prefix cache's tokens held, loaded, lent (host rows a staged request borrowed instead of a
copy), shared (by running requests), evicted, and (PD decode) not sent by the prefill because the
tree held them (radix cache on): plain counts, not ``now/initial``."""


def parse_idle_reports(log: str, layout: str = "dsa") -> list[dict]:
    """Every idle report of ``layout`` ("dsa" or "c4") in ``log``, in order: ``counts`` (pool name
    -> (free now, free at start)), ``leak``, ``selected``, ``misses``, the prefix counts and, where
    the line has them, ``steps``, ``host_us_per_step``, ``resident``, ``admitted_resident``,
    ``demotions``, ``promotions`` and (elastic hot buffers) the rows ``grown`` and ``given_back``
    (0 where absent). ValueError for another layout."""
    if layout not in ("dsa", "c4"):
        raise ValueError(f"layout={layout!r}: allowed values are 'dsa', 'c4'")
    reports = []
    for m in IDLE_LINE.finditer(log):
        if (m.group("c4") is not None) != (layout == "c4"):
            continue
        counts, prefix = {}, dict.fromkeys(PREFIX_COUNTS, 0)
        for part in m.group("pools").split():
            name, value = part.split("=")
            if name in prefix:
                prefix[name] = int(value)
                continue
            now, initial = value.split("/")
            counts[name] = (int(now), int(initial))
        number = lambda name, kind=int: kind(m.group(name) or 0)  # noqa: E731
        reports.append({"counts": counts, **prefix, "leak": m.group("leak") == "yes",
                        "selected": number("selected"), "misses": number("misses"), "steps": number("steps"),
                        "host_us_per_step": number("host_us", float), "resident": number("resident"),
                        "admitted_resident": number("admitted"), "demotions": number("demotions"),
                        "promotions": number("promotions"), "grown": number("grown"),
                        "given_back": number("given_back")})
    return reports


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@dataclass
class Server:
    """A running SGLang server (see :func:`start_server`)."""

    port: int
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def generate(
        self, input_ids: Any, max_new_tokens: int | list[int], timeout: float = 1800, rid: Optional[str] = None,
        **sampling: Any
    ) -> Any:
        """POST /generate with token ids (one list or a list of lists); greedy by default.
        ``max_new_tokens`` is one count for every prompt, or a list with one count per prompt
        (sent as one sampling-params object per prompt). ``rid`` names the request (for
        /abort_request); other keywords are sampling params."""
        params = {"temperature": 0.0, "ignore_eos": True, **sampling}
        if isinstance(max_new_tokens, list):
            if not isinstance(input_ids, list) or len(max_new_tokens) != len(input_ids) or not input_ids \
                    or not isinstance(input_ids[0], list):
                raise ValueError("max_new_tokens: a list needs a list of prompts of the same length")
            per_prompt: Any = [{**params, "max_new_tokens": n} for n in max_new_tokens]
        else:
            per_prompt = {**params, "max_new_tokens": max_new_tokens}
        body = {"input_ids": input_ids, "sampling_params": per_prompt}
        if rid is not None:
            body["rid"] = rid
        return post_json(f"{self.url}/generate", body, timeout)

    def abort(self, rid: str) -> None:
        post_json(f"{self.url}/abort_request", {"rid": rid}, 30)

    def idle_reports(self, layout: str = "dsa") -> list[dict]:
        """Every idle report of ``layout`` in the log, parsed (:func:`parse_idle_reports`)."""
        return parse_idle_reports(self.log(), layout)

    def settle(self, timeout: float = 120) -> None:
        """Return once every busy -> idle transition so far is in the log.

        Two ``/server_info`` round trips: the scheduler answers each (``GetInternalStateReq``) in
        its loop, and between answering the first and receiving the second it passes through
        ``on_idle`` (our idle report hook) with nothing running, so a report due since any earlier
        request is logged before the second answer arrives."""
        for _ in range(2):
            with urllib.request.urlopen(f"{self.url}/server_info", timeout=timeout) as response:
                response.read()

    def stop(self, grace: float = 20.0) -> None:
        """Stop the server and every process it spawned (by process group)."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)


def post_json(url: str, body: dict, timeout: float) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body.strip() else None  # /abort_request answers 200 with no body


def server_env(*, cpu: bool, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("SGLANG_HISPARSE_DUMMY_INIT", "normal")
    env["PYTHONUNBUFFERED"] = "1"
    if cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.setdefault("SGLANG_HISPARSE_CPU_BATCH_INVARIANT", "1")  # testing/batch_invariant.py
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_STAND_IN), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


PORT_TAKEN = "address already in use"
"""What SGLang's HTTP server logs when its port was taken between ``free_port`` and its bind
(uvicorn's ``[Errno 98]``); the process then stays up without serving."""
PORT_TRIES = 3


class PortTaken(RuntimeError):
    """The server could not bind its port; it was stopped (``start_server`` tries another)."""


def start_server(
    *,
    model: str = "tiny-dsa-cpu",
    hisparse_config: Optional[str] = None,
    extra_args: Optional[list[str]] = None,
    env: Optional[dict[str, str]] = None,
    log_dir: Path,
    cpu: Optional[bool] = None,
    name: str = "server",
    max_total_tokens: int = 16384,
    ready_timeout: float = 600.0,
    radix_cache: bool = False,
) -> Server:
    """Launch a server and wait until /health answers (raises with the log tail if it dies).
    ``radix_cache``: leave SGLang's radix cache on (prefix reuse); off by default. A server whose
    port was taken before it bound it is stopped and started again on another (``PORT_TRIES``
    in all; the log of the last try is kept)."""
    cpu = (not has_cuda()) if cpu is None else cpu
    model_path = Path(model) if os.path.isdir(model) else MODELS_DIR / model
    for attempt in range(1, PORT_TRIES + 1):
        port = free_port()
        args = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model_path), "--load-format", "dummy", "--skip-tokenizer-init",
            "--host", "127.0.0.1", "--port", str(port),
            "--max-total-tokens", str(max_total_tokens), "--random-seed", "0",
        ]
        if not radix_cache:
            args.append("--disable-radix-cache")
        if cpu:
            args += ["--device", "cpu"]
        if hisparse_config is not None:
            args += ["--enable-hisparse", "--hisparse-config", hisparse_config]
        args += list(extra_args or [])
        try:
            return run_server(args, port=port, env=server_env(cpu=cpu, extra=env), log_dir=log_dir, name=name,
                              ready_timeout=ready_timeout)
        except PortTaken:
            if attempt == PORT_TRIES:
                raise
            print(f"[launcher] {name}: port {port} was taken before the server bound it; trying another", flush=True)
    raise AssertionError("unreachable")


def run_server(command: list[str], *, port: int, env: dict[str, str], log_dir: Path, name: str = "server",
               ready_timeout: float = 600.0) -> Server:
    """Run ``command`` (a server that will listen on 127.0.0.1:``port``) in its own process group,
    its output in ``<log_dir>/<name>.log``, and wait until /health answers 200 (raises with the
    log tail if the process exits or the time runs out; :class:`PortTaken`, the server stopped,
    when its log says the port was taken)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(port=port, process=process, log_path=log_path, args=command)
    deadline = time.time() + ready_timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n" + "\n".join(server.log().splitlines()[-40:]))
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if PORT_TAKEN in server.log():
            server.stop()
            raise PortTaken(f"{name}: port {port} taken:\n" + "\n".join(server.log().splitlines()[-5:]))
        time.sleep(2)
    server.stop()
    raise TimeoutError(f"{name} not ready after {ready_timeout}s:\n" + "\n".join(server.log().splitlines()[-40:]))


def wait_for_idle_report(server: Server, timeout: float = 120.0, after: int = 0) -> dict:
    """The first idle report after the first ``after`` ones (the server logs one per busy ->
    idle transition)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        reports = server.idle_reports()
        if len(reports) > after:
            return reports[-1]
        time.sleep(1)
    raise TimeoutError(f"no sglang-hisparse idle report within {timeout}s")


def scrape_metrics(server: Server, prefix: str = "sglang_hisparse_") -> dict[str, float]:
    """The server's ``/metrics`` series whose names start with ``prefix``, summed over labels (one
    value per series name). Needs ``--enable-metrics``."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
        text = response.read().decode()
    series: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            series[name] = series.get(name, 0.0) + value
    return series


def abort_two_mid_decode(server: Server, lengths: list[int], new_tokens: int, *, seed: int,
                         prefix: Sequence[int] = ()) -> dict:
    """Send one request per entry of ``lengths`` (random prompts after ``prefix``, e.g. a cached
    system prompt), wait until the server decodes,
    abort the first and the third (one short, one long when ``lengths`` is so ordered), wait for
    all of them. Returns ``{"aborted": [...], "finished": [...]}``: the finish-reason types of the
    aborted requests that returned a result, and whether each other request returned one."""
    rng = random.Random(seed)
    rids = [f"abort-{i}-{uuid.uuid4().hex[:8]}" for i in range(len(lengths))]
    results: dict[str, Any] = {}

    def run(rid: str, length: int) -> None:
        ids = list(prefix) + [rng.randrange(2, 2000) for _ in range(length)]
        try:
            results[rid] = server.generate(ids, new_tokens, rid=rid, timeout=900)
        except Exception as e:  # noqa: BLE001 - aborted requests may end with an error status
            results[rid] = e

    threads = [threading.Thread(target=run, args=(rid, n)) for rid, n in zip(rids, lengths)]
    for t in threads:
        t.start()
    deadline = time.time() + 300
    while "Decode batch" not in server.log() and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(2)
    aborted = (rids[0], rids[2])
    for rid in aborted:
        server.abort(rid)
    for t in threads:
        t.join(timeout=900)
    return {"aborted": [results[r]["meta_info"]["finish_reason"]["type"] for r in aborted
                        if isinstance(results.get(r), dict)],
            "finished": [isinstance(results.get(r), dict) for r in rids if r not in aborted]}
