"""Which requests a HiSparse server can ever admit, and whether the server can admit any.

Pure policy on plain numbers (the allocator and the coordinator supply them; the seams in
``patches/`` apply the answers). SGLang admits a request when its token budget fits what the
allocator's ``available_size()`` reports; with HiSparse that number is bounded, even on an idle
server, by the device pool (a prefill's rows stay on device until staging completes), by the
logical ids and by the host rows. A request whose budget exceeds that bound would wait in SGLang's
queue forever and block every request behind it; :func:`refusal` names such a request so it can
be refused at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_hisparse.errors import HiSparsePluginError


def hot_buffer_rows(buffer_size: int, window: int, page: int) -> int:
    """Device rows one hot buffer holds: B slots plus the ``window`` newest positions, in whole
    pages (``padded``)."""
    return -(-(buffer_size + window) // page) * page


@dataclass(frozen=True)
class Capacity:
    """The sizes that bound admission on an idle server (tokens = rows)."""

    device_rows: int
    hot_buffer_rows: int
    """Rows one decoding request holds: B + the newest token's page, whole pages."""
    page_size: int
    logical_ids: int
    host_rows: int
    device_buffer_size: int
    host_row_bytes: int = 0
    """Pinned bytes of one host row (every layer's KV row of one token)."""

    @property
    def idle_room(self) -> int:
        """What ``available_size()`` reports when no request is live."""
        return max(0, min(self.logical_ids, self.host_rows, self.device_rows))

    def largest_buffer_size(self) -> int:
        """The largest B whose hot buffer leaves one page of the device pool for a prefill."""
        pages_for_buffer = (self.device_rows - self.page_size) // self.page_size
        return pages_for_buffer * self.page_size - 1

    def describe(self) -> str:
        return f"device pool {self.device_rows} rows, logical ids {self.logical_ids}, host rows {self.host_rows}"


def capacity_of(allocator, hot, host_pool) -> Capacity:
    """The capacity of a server from its allocator, hot buffers and host pool."""
    return Capacity(
        device_rows=allocator.device_size, hot_buffer_rows=hot.padded, page_size=allocator.page_size,
        logical_ids=allocator.logical_size, host_rows=host_pool.capacity_tokens,
        device_buffer_size=hot.open_size, host_row_bytes=host_pool.get_size_per_token(),
    )


def capacity_line(capacity: Capacity) -> str:
    """The start-up capacity line of a server (the planner prints the same line for a plan)."""
    return (
        f"sglang-hisparse capacity: device rows {capacity.device_rows} (a request holds its own rows, in a hot "
        f"buffer at most {capacity.hot_buffer_rows}: {capacity.device_rows // capacity.hot_buffer_rows} long "
        f"requests at once), host rows "
        f"{capacity.host_rows} (pinned {capacity.host_rows * capacity.host_row_bytes / (1 << 30):.2f} GiB per rank), "
        f"logical ids {capacity.logical_ids}; admission room when idle {capacity.idle_room} tokens"
    )


def check_startup(capacity: Capacity) -> None:
    """Raise HiSparsePluginError (one line, with the numbers) when the device pool cannot hold one
    full hot buffer next to a page for a prefill: a request longer than B could then never decode
    beside anything, and the server would accept requests it never serves."""
    if capacity.device_rows - capacity.hot_buffer_rows >= capacity.page_size and capacity.idle_room >= capacity.page_size:
        return
    limit = capacity.largest_buffer_size()
    fix = (
        f"use device_buffer_size <= {limit}" if limit >= 1 else "no device_buffer_size fits"
    )
    raise HiSparsePluginError(
        f"sglang-hisparse: invalid device_buffer_size={capacity.device_buffer_size}: one decoding request "
        f"holds {capacity.hot_buffer_rows} device rows and a prefill needs at least one page "
        f"({capacity.page_size}), but the device KV pool has {capacity.device_rows} rows; {fix}, or give "
        "the pool more memory (--max-total-tokens, --mem-fraction-static)"
    )


def refusal(
    capacity: Capacity,
    *,
    prompt_len: int,
    max_new_tokens: int,
    ignore_eos: bool,
    clip_new_tokens: int,
    ignore_eos_reserve: int,
) -> Optional[str]:
    """The error for a request SGLang could never admit on this server, or None.

    Mirrors SGLang 0.5.17's PrefillAdder on an idle server (radix cache off, which HiSparse
    requires), ``room`` being the idle admission room:

    * ``ignore_eos``: the page-rounded prompt plus every new token plus the reserve must stay
      strictly below the room (``add_one_req_ignore_eos`` and its future-token check);
    * otherwise: ``prompt + min(max_new_tokens, clip) + page`` must be strictly below the room.
    """
    page = capacity.page_size
    room = capacity.idle_room
    if ignore_eos:
        paged = -(-prompt_len // page) * page
        need = paged + max_new_tokens + ignore_eos_reserve
        budget = f"prompt {prompt_len} rounded to pages + {max_new_tokens} new tokens + reserve {ignore_eos_reserve}"
    else:
        estimate = min(max_new_tokens, clip_new_tokens)
        need = prompt_len + estimate + page
        budget = f"prompt {prompt_len} + new-token estimate {estimate} + one page {page}"
    if need < room:
        return None
    return (
        f"sglang-hisparse: this request needs {need} tokens of admission room ({budget}) but this "
        f"server never has more than {room} ({capacity.describe()}); shorten the prompt or "
        "max_new_tokens, or restart with a smaller device_buffer_size or a larger KV pool"
    )
