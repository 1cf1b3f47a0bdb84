"""Real CPU servers for the end-to-end tests, started and stopped so that a 2-core CI machine
spends its time on what the tests check.

* ``QUIET``: every test server gets ``--sleep-on-idle``. Without it an idle SGLang scheduler polls
  its sockets in a busy loop and holds a core: a module-scoped server pair left two cores spinning
  while the module's other servers started and decoded (3-30x slower). With it the idle scheduler
  waits in ``zmq.Poller.poll``, which returns as soon as a request arrives (no added latency).
* :func:`start_all`: several servers started side by side. A start is mostly imports in three
  processes, below one core on average, so two starts together take about as long as one.
* :func:`stop_soon`: a server stopped in the background (SGLang's shutdown takes ~5 s); the
  session waits for every such stop before it ends (``conftest.py``).
* :func:`settle`: the number of idle reports once every busy -> idle transition so far is
  reported. A quiet scheduler logs a transition's report (``patches/idle_report.py``, AFTER
  ``on_idle``) when its one-second poll ends or a message arrives, so right after a request
  returns its report may still be to come; counting reports then would take that one for the
  next request's. Tests count with ``settle`` (servers are settled once when they start).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

from sglang_hisparse.serving.launcher import Server, start_server

QUIET = ["--sleep-on-idle"]

_stopping: list[threading.Thread] = []


def start(**kwargs: Any) -> Server:
    """:func:`start_server` with ``QUIET`` added to its extra arguments; returns it settled."""
    kwargs["extra_args"] = list(kwargs.get("extra_args") or []) + QUIET
    server = start_server(**kwargs)
    settle(server)
    return server


def settle(server: Server) -> int:
    """Wait until every busy -> idle transition so far is in the log (:meth:`Server.settle`); the
    number of idle reports."""
    server.settle()
    return len(server.idle_reports())


def start_all(*specs: dict, workers: int = 3) -> list[Server]:
    """Start one server per spec (keyword arguments of :func:`start`) side by side; returns them
    in spec order. If any fails, the others are stopped and the first error is raised."""
    with ThreadPoolExecutor(max_workers=min(workers, len(specs))) as pool:
        futures = [pool.submit(start, **spec) for spec in specs]
    servers, errors = [], []
    for f in futures:
        try:
            servers.append(f.result())
        except BaseException as e:  # noqa: BLE001 - re-raised below, after stopping the others
            errors.append(e)
    if errors:
        stop_now(servers)
        raise errors[0]
    return servers


def start_in_background(**spec: Any) -> Future:
    """Start a server on a background thread (e.g. one that must refuse to start, while the
    module's other servers start); ``.result()`` is the server or raises the start's error."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(start(**spec))
        except BaseException as e:  # noqa: BLE001 - handed to whoever takes the result
            future.set_exception(e)

    threading.Thread(target=run, name=f"start-{spec.get('name', 'server')}", daemon=True).start()
    return future


def stop_soon(servers: Server | Iterable[Server]) -> None:
    """Stop the server(s) in a background thread; :func:`wait_for_stops` joins them."""
    for server in [servers] if isinstance(servers, Server) else list(servers):
        t = threading.Thread(target=server.stop, name=f"stop-{server.port}", daemon=True)
        t.start()
        _stopping.append(t)


def stop_now(servers: Iterable[Server]) -> None:
    stop_soon(servers)
    wait_for_stops()


def wait_for_stops() -> None:
    while _stopping:
        _stopping.pop().join(timeout=120)


def converse(send: Callable[[list[int]], tuple[list[int], int]], conversations: list[list[list[int]]],
             turns: int) -> list[tuple[list[int], int]]:
    """Multi-turn chat: the conversations turn by turn, alternating; every turn sends the history
    (messages and replies so far) plus the next message through ``send`` (a prompt -> its output
    ids and SGLang's ``cached_tokens``). Returns (output, cached) per turn, in sending order."""
    history: list[list[int]] = [[] for _ in conversations]
    results = []
    for turn in range(turns):
        for c, conv in enumerate(conversations):
            prompt = history[c] + conv[turn]
            output, cached = send(prompt)
            history[c] = prompt + output
            results.append((output, cached))
    return results
