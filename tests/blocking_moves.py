"""A CPU check that our code moves nothing to the device with a blocking copy inside given calls.

On CUDA a ``.to(device)`` from pageable memory without ``non_blocking=True`` syncs the stream:
under the overlap scheduler that stalls the host until the forward in flight ends, every decode
step. On CPU such moves are no-ops, so the calls themselves are recorded: every ``Tensor.to`` with
a device (or a tensor) argument and no ``non_blocking=True`` made from ``sglang_hisparse`` code,
except in the CPU twins of device copies (``TORCH_TWINS``: on CUDA the transfer kernels or the
resolver kernel run instead). The GPU machine's sync tests (tests/gpu/test_host_syncs.py,
test_c4_host_syncs.py) are the CUDA counterpart, which see every kind of sync.
"""

from __future__ import annotations

import traceback

import torch

TORCH_TWINS = {("c4_host_pool.py", "copy_items"), ("c4_rows.py", "read"), ("c4_rows.py", "write"),
               ("host_pool.py", "copy_rows_torch")}
"""(file, function) of the CPU twins of device copies."""


class BlockingMoves:
    """Guards methods of objects (:meth:`guard`); ``sites`` lists ``file:line (function)`` of each
    blocking move made inside a guarded call."""

    def __init__(self, monkeypatch) -> None:
        self.sites: list[str] = []
        self._monkeypatch = monkeypatch
        self._real_to = torch.Tensor.to

    def _recording_to(self, tensor, *args, **kwargs):
        moves = "device" in kwargs or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args)
        if moves and not kwargs.get("non_blocking", False):
            ours = [f for f in traceback.extract_stack()[:-2] if "/sglang_hisparse/" in f.filename]
            if ours:
                where = ours[-1]
                name = where.filename.rsplit("/", 1)[-1]
                if (name, where.name) not in TORCH_TWINS:
                    self.sites.append(f"{name}:{where.lineno} ({where.name})")
        return self._real_to(tensor, *args, **kwargs)

    def guard(self, obj, *names: str) -> None:
        """Record blocking moves made inside ``obj.<name>(...)`` for each name (until the test ends)."""
        recorder = self

        def recording_to(tensor, *args, **kwargs):
            return recorder._recording_to(tensor, *args, **kwargs)

        for name in names:
            method = getattr(obj, name)

            def guarded(*args, _method=method, **kwargs):
                with self._monkeypatch.context() as m:
                    m.setattr(torch.Tensor, "to", recording_to)
                    return _method(*args, **kwargs)

            self._monkeypatch.setattr(obj, name, guarded)
