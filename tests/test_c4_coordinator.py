"""DeepSeek-V4's coordinator (decode/c4_coordinator.py) driven through SGLang's protocol on CPU.

SGLang's V4 model cannot run on the CPU engine (docs/deepseek_v4/cpu-findings.md), so a stand-in
plays its part: every C4 entry of every request and layer has known bytes; the "compressor" writes
an entry where the C4 pool's mapping says (prefill: each completed entry; decode: the entry the
step's token completes), the "indexer" selects random entries (the newest at times) and the rows
``swap_in_selected_pages`` returns must hold exactly the selected entries' bytes, in every layer,
whatever the path (fast, long, misses copied from host, resident). Requests of 0 to 725 entries
against B = 128, prefilled here or admitted from a PD transfer (SGLang's direct-to-host calls, the
transfer writing whole pages), with residency off (V4's default) and on (demotions under prefill
and decode pressure), finishing at prefill, in staging, before their transfer and after decoding;
every pool back to its initial state at the end. The reference resolver runs the C4 path here;
the kernel's C4 path is checked against it by tests/test_kernel_emulation.py and on the GPU.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.decode.c4_coordinator import C4Coordinator
from sglang_hisparse.errors import HiSparsePluginError
from sglang_hisparse.memory.c4_allocator import C4Allocator, completed_entry_ids
from sglang_hisparse.memory.paging import PageAllocator
from sglang_hisparse.resolver.c4_rows import C4_ITEM_BYTES, C4_PAGE_BYTES, C4_PAGE_ENTRIES, C4PagedRows

TOKEN_PAGE, LAYERS, B, TOP_K = 256, 2, 128, 32
MAX_REQS, MAX_TOKENS = 6, 4096


class Tokens:
    """Stand-in of SGLang's SWA allocator (token ids, pages of 256) over a C4 pool stand-in, on
    ``device`` (where SGLang keeps them; tests/gpu/test_c4_host_syncs.py runs the rig on CUDA)."""

    def __init__(self, tokens: int, c4_rows: int, device: str = "cpu"):
        self.pages = PageAllocator(tokens // TOKEN_PAGE, TOKEN_PAGE, device, debug=device == "cpu")
        self.page_size, self.size_full, self.size, self.size_swa = TOKEN_PAGE, tokens, tokens, tokens // 8
        self.need_sort, self.full_to_swa_index_mapping = False, None
        self.c4_pool = SimpleNamespace(
            size=c4_rows, dtype=torch.uint8, device=torch.device(device), layer_num=LAYERS, mapping=None,
            kv_buffer=[torch.zeros(c4_rows // C4_PAGE_ENTRIES + 1, C4_PAGE_BYTES, dtype=torch.uint8, device=device)
                       for _ in range(LAYERS)])
        self.c4_pool.attach_mapping = lambda t: setattr(self.c4_pool, "mapping", t)
        self._kvcache = SimpleNamespace(c4_kv_pool=self.c4_pool, c4_logical_size=tokens // 4)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        return self.pages.extend(prefix_lens_cpu, seq_lens_cpu, last_loc)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        step = self.pages.decode(seq_lens_cpu.tolist(), last_loc)
        return None if step is None else step.ids

    def available_size(self):
        return self.pages.available_tokens()

    full_available_size = swa_available_size = available_size

    def free(self, ids):
        self.pages.free_tokens(ids.to(torch.int64))

    def debug_print(self):
        return ""


class Rig:
    """Allocator, coordinator and the model stand-in's truth: entry bytes per (request, layer)."""

    def __init__(self, seed: int, tp_group, residency: bool = False, device: str = "cpu", **config_keys):
        """``residency`` (off: DeepSeek-V4's default, ``config.V4_RESIDENCY_DEFAULT``) and other
        config keys. ``device``: where SGLang's tensors live (the truth stays on CPU); the debug
        checks, which read device state back, only on CPU."""
        self.rng = random.Random(seed)
        self.device = device
        self.tokens = Tokens(1 << 15, 2048, device)
        self.alloc = C4Allocator(self.tokens, debug=device == "cpu")
        self.rtt = torch.zeros(MAX_REQS, MAX_TOKENS, dtype=torch.int32, device=device)
        config = HiSparseConfig(top_k=TOP_K, device_buffer_size=B, resolver="reference", residency=residency,
                                **config_keys)
        self.coord = C4Coordinator(SimpleNamespace(req_to_token=self.rtt), self.alloc, TOP_K, B, device, tp_group,
                                   host_to_device_ratio=4, config=config, pin_memory=device != "cpu")
        self.truth: dict[int, torch.Tensor] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self.initial = self.free_counts()

    def free_counts(self) -> tuple:
        return (self.tokens.pages.available_tokens(), self.alloc.c4.rows.room(), self.coord.mirror.pool.available_size(),
                int(self.alloc.c4.mapping.logical_to_device[:-1].count_nonzero()))

    def write_entries(self, idx: int, token_ids: torch.Tensor, first_token: int) -> None:
        """The compressor: each entry these tokens complete, written at its mapped row, every layer."""
        entries = completed_entry_ids(token_ids)
        positions = ((first_token + torch.nonzero(token_ids % 4 == 3).view(-1)) // 4).cpu()
        rows = self.tokens.c4_pool.mapping[entries]
        assert bool((rows > 0).all()), "a completed entry has no row to be written to"
        for layer in range(LAYERS):
            C4PagedRows(self.tokens.c4_pool.kv_buffer[layer]).write(rows, self.truth[idx][layer, positions])

    def new_request(self, idx: int, tokens: int, allocate) -> torch.Tensor:
        """Fresh entry bytes for slot ``idx`` and its ``tokens`` token ids from ``allocate`` (one of
        the allocator's extend calls), written into the request table; returns the ids."""
        self.truth[idx] = torch.randint(0, 256, (LAYERS, MAX_TOKENS // 4, C4_ITEM_BYTES), dtype=torch.uint8,
                                        generator=self.gen)
        z, n = torch.tensor([0]), torch.tensor([tokens])
        ids = allocate(z, z, n, n, torch.tensor([-1], device=self.device), tokens)
        assert ids is not None
        self.rtt[idx, :tokens] = ids.to(torch.int32)
        return ids

    def prefill(self, idx: int, tokens: int):
        ids = self.new_request(idx, tokens, self.alloc.alloc_extend)
        self.write_entries(idx, ids, 0)
        req = SimpleNamespace(req_pool_idx=idx, rid=f"r{idx}", extend_range=SimpleNamespace(end=tokens),
                              kv=SimpleNamespace(kv_allocated_len=tokens))
        self.coord.admit_request_into_staging(req)
        return req

    def pd_admit(self, idx: int, tokens: int, *, arrive: bool = True):
        """A PD decode instance's part, as SGLang 0.5.17 plays it (disaggregation/decode.py): token
        ids only, host rows for ``host_token_len`` entries from ``mem_pool_host``; then the transfer
        writes the prefill's C4 pages (FlashMLA layout) into the host pages ``rows[::64] // 64``,
        every layer (what Mooncake does with ``get_contiguous_buf_infos``), and the request is
        admitted. ``arrive=False``: the transfer never comes (the request is only preallocated)."""
        self.new_request(idx, tokens, self.alloc.alloc_logical_only)
        entries = self.coord.host_token_len(tokens)
        host = self.coord.mem_pool_host.alloc_paged_token_slots(
            self.coord.req_to_host_pool, self.coord.req_to_host_pool_allocated_len, idx, 0, entries)
        assert host.numel() == entries
        req = SimpleNamespace(req_pool_idx=idx, rid=f"pd{idx}", extend_range=SimpleNamespace(end=tokens),
                              kv=SimpleNamespace(kv_allocated_len=tokens))
        if not arrive:
            return req
        pages = host[::C4_PAGE_ENTRIES] // C4_PAGE_ENTRIES
        ptrs, lens, items = self.coord.mem_pool_host.get_contiguous_buf_infos()
        assert items == [C4_PAGE_BYTES] * LAYERS and len(ptrs) == LAYERS
        for layer in range(LAYERS):
            prefill_pages = torch.zeros(pages.numel() + 1, C4_PAGE_BYTES, dtype=torch.uint8)
            C4PagedRows(prefill_pages).write(torch.arange(entries) + C4_PAGE_ENTRIES, self.truth[idx][layer, :entries])
            destination = self.coord.mem_pool_host.kv_buffer[layer]
            assert destination.data_ptr() == ptrs[layer] and destination.nbytes == lens[layer]
            destination[pages] = prefill_pages[1:]
        self.coord.admit_request_direct(req)
        return req

    def step(self, reqs: list) -> None:
        """One decode step of ``reqs``: SGLang's calls, the compressor, then a check of every layer."""
        idxs = torch.tensor([r.req_pool_idx for r in reqs])
        lens = torch.tensor([r.kv.kv_allocated_len + 1 for r in reqs])
        last = self.rtt[idxs, lens - 2].to(torch.int64)
        ids = self.alloc.alloc_decode(lens.to(self.device), lens, last)
        self.rtt[idxs, lens - 1] = ids.to(torch.int32)
        self.coord.map_last_loc_to_buffer(lens.to(self.device), ids, idxs.to(self.device), lens, idxs)
        for r, n, tok in zip(reqs, lens.tolist(), ids):
            r.kv.kv_allocated_len = n
            self.write_entries(r.req_pool_idx, tok.view(1), n - 1)
        self.coord.wait_for_pending_backup()
        self.check_layers(reqs)

    def check_layers(self, reqs: list) -> None:
        entries = [r.kv.kv_allocated_len // 4 for r in reqs]
        top = torch.full((len(reqs), TOP_K), -1, dtype=torch.int32)
        for i, E in enumerate(entries):
            picks = self.rng.sample(range(E), min(E, TOP_K - 1)) if E else []
            if E and self.rng.random() < 0.5 and E - 1 not in picks:
                picks.append(E - 1)
            top[i, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
        idxs = torch.tensor([r.req_pool_idx for r in reqs], device=self.device)
        self.coord.num_real_reqs.fill_(len(reqs))  # as SGLang's model runner does before a decode forward
        for layer in range(LAYERS):
            rows = self.coord.swap_in_selected_pages(idxs, torch.tensor(entries, dtype=torch.int32, device=self.device),
                                                     top.to(self.device), layer).cpu()
            view = C4PagedRows(self.tokens.c4_pool.kv_buffer[layer])
            for i, r in enumerate(reqs):
                sel = top[i][top[i] >= 0].long()
                got = view.read(rows[i, : sel.numel()].long()).cpu()
                assert torch.equal(got, self.truth[r.req_pool_idx][layer, sel]), \
                    f"layer {layer} request {r.rid} (E={entries[i]}) read wrong entry bytes"
                assert bool((rows[i, sel.numel():] == -1).all())

    def finish(self, req) -> None:
        self.coord.request_finished(req)
        self.alloc.free(self.rtt[req.req_pool_idx, : req.kv.kv_allocated_len].to(torch.int64))


def read_newest(rig: Rig, req) -> None:
    """Select only each request's newest entry ``E - 1`` in every layer: its bytes must be the
    truth (a hot buffer reads it in slot B, a resident request in its own row)."""
    E = req.kv.kv_allocated_len // 4
    top = torch.full((1, TOP_K), -1, dtype=torch.int32)
    top[0, 0] = E - 1
    rig.coord.num_real_reqs.fill_(1)
    for layer in range(LAYERS):
        rows = rig.coord.swap_in_selected_pages(torch.tensor([req.req_pool_idx]), torch.tensor([E], dtype=torch.int32),
                                                top, layer)
        got = C4PagedRows(rig.tokens.c4_pool.kv_buffer[layer]).read(rows[0, :1].long())
        assert torch.equal(got, rig.truth[req.req_pool_idx][layer, E - 1:E]), (req.rid, layer)


def resident(rig: Rig, req) -> bool:
    return rig.coord.residency.residency.holds(req.req_pool_idx)


@pytest.mark.parametrize("residency", [False, True], ids=["hot_buffers", "residency"])
def test_decoding_reads_exactly_the_selected_entries_and_every_pool_comes_back(gloo_world, residency):
    rig = Rig(seed=3, tp_group=gloo_world, residency=residency)
    lengths = [2, 9, 515, 600, 2203, 2900]  # 0 .. 725 entries: empty, fast path, crossing B, long
    reqs = [rig.prefill(i, n) for i, n in enumerate(lengths)]
    assert rig.coord.has_ongoing_staging()
    ready = rig.coord.collect_ready_reqs()
    assert [r.rid for r in ready] == [r.rid for r in reqs] and not rig.coord.has_ongoing_staging()
    rig.check_layers(reqs)
    for _ in range(13):  # every phase of 4, entries completed and backed up
        rig.step(reqs)
    for r in reqs[:3]:
        rig.finish(r)
    for _ in range(6):
        rig.step(reqs[3:])
    for r in reqs[3:]:
        rig.finish(r)
    assert rig.free_counts() == rig.initial
    line = rig.coord.idle_report()
    assert "leak=no" in line and "c4_rows_free=2048/2048" in line and rig.coord.idle_report() is None
    # every request with an entry stays resident (rows to spare); the one without opens a buffer
    assert ("admitted_resident=5 demotions=0" in line) if residency else ("resident=" not in line), line


@pytest.mark.parametrize("residency", [False, True], ids=["hot_buffers", "residency"])
def test_a_decode_step_moves_nothing_to_the_device_with_a_blocking_copy(gloo_world, monkeypatch, residency):
    """The overlap scheduler prepares step n + 1 while the device runs step n: a blocking copy from
    pageable memory to the device syncs the stream in every decode step. Every device move our
    code makes in the protocol calls of entering decode, a decode step and finishing must be
    non-blocking (tests/blocking_moves.py; tests/gpu/test_c4_host_syncs.py is the CUDA counterpart)."""
    from blocking_moves import BlockingMoves

    rig = Rig(seed=13, tp_group=gloo_world, residency=residency)
    moves = BlockingMoves(monkeypatch)
    moves.guard(rig.coord, "admit_request_into_staging", "collect_ready_reqs", "device_rows_short",
                "map_last_loc_to_buffer", "wait_for_pending_backup", "request_finished")
    reqs = [rig.prefill(i, n) for i, n in enumerate([9, 600, 2203, 2900])]
    rig.coord.collect_ready_reqs()
    for _ in range(9):  # entries completed and backed up, short buffers grown, resident pages started
        rig.coord.device_rows_short([r.req_pool_idx for r in reqs], [r.kv.kv_allocated_len for r in reqs])
        rig.step(reqs)
    for r in reqs:
        rig.finish(r)
    assert not moves.sites, sorted(set(moves.sites))
    assert rig.free_counts() == rig.initial


@pytest.mark.parametrize("residency", [False, True], ids=["hot_buffers", "residency"])
def test_a_request_crossing_b_entries_keeps_reading_its_own_entries(gloo_world, residency):
    """From the fast path (E <= B) into the long path: the entry B lands in slot B, older entries
    are then read from their slots or from host."""
    rig = Rig(seed=5, tp_group=gloo_world, residency=residency)
    req = rig.prefill(0, 4 * B - 6)  # B - 2 entries; entry B completes 10 steps later
    rig.coord.collect_ready_reqs()
    for _ in range(40):
        rig.step([req])
    assert req.kv.kv_allocated_len // 4 > B + 5
    rig.finish(req)
    assert rig.free_counts() == rig.initial


@pytest.mark.parametrize("residency", [False, True], ids=["hot_buffers", "residency"])
def test_requests_leaving_in_staging_or_at_prefill_leave_nothing_behind(gloo_world, residency):
    rig = Rig(seed=7, tp_group=gloo_world, residency=residency)
    staged = rig.prefill(0, 1000)
    rig.finish(staged)  # aborted while its copy to host is queued
    at_prefill = rig.prefill(1, 300)
    rig.coord.collect_ready_reqs()
    rig.finish(at_prefill)  # finished right after prefill (one token)
    never_staged = rig.prefill(2, 77)
    rig.coord.collect_ready_reqs()
    assert "leak=yes" in rig.coord.idle_report()  # a request still holds rows
    rig.finish(never_staged)
    assert rig.free_counts() == rig.initial


@pytest.mark.parametrize("residency", [False, True], ids=["hot_buffers", "residency"])
def test_host_rows_are_entries_and_the_protocol_numbers_say_so(gloo_world, residency):
    rig = Rig(seed=9, tp_group=gloo_world, residency=residency)
    req = rig.prefill(0, 1030)
    assert rig.coord.host_token_len(1030) == 257
    assert int(rig.coord.req_to_host_pool_allocated_len[0]) == 320  # whole pages of 64 entries
    rig.coord.collect_ready_reqs()
    stats = rig.coord.get_token_stats()
    # resident: its five pages of prefill rows; else a hot buffer
    assert stats.host_tokens == 320 and stats.device_tokens == (320 if residency else rig.coord.padded_buffer_size)
    assert rig.coord.device_rows_short([0], [1030]) == 0
    rig.finish(req)


@pytest.mark.parametrize("residency", [False, True], ids=["hot_buffers", "residency"])
def test_pd_admitted_requests_read_the_transferred_entries_and_every_pool_comes_back(gloo_world, residency):
    """PD decode (SGLang's direct-to-host path): requests of 0 to 725 entries, short (every entry
    loaded into its slot), crossing B while decoding, and long (empty buffer but the newest entry in
    slot B), decoding beside a colocated one: every selected entry's bytes are the transferred
    ones in every layer and step; every pool is back at the end."""
    rig = Rig(seed=11, tp_group=gloo_world, residency=residency)
    colocated = rig.prefill(0, 700)
    rig.coord.collect_ready_reqs()
    lengths = [3, 64, 4 * B - 6, 515, 2900]
    reqs = [rig.pd_admit(i + 1, n) for i, n in enumerate(lengths)]
    assert not rig.coord.has_ongoing_staging()
    rig.check_layers([colocated, *reqs])
    for _ in range(14):
        rig.step([colocated, *reqs])
    for r in reqs[:2]:
        rig.finish(r)
    for _ in range(5):
        rig.step([colocated, *reqs[2:]])
    for r in (colocated, *reqs[2:]):
        rig.finish(r)
    assert rig.free_counts() == rig.initial
    assert "leak=no" in rig.coord.idle_report()


@pytest.mark.parametrize("residency", [False, True], ids=["hot_buffers", "residency"])
def test_a_long_pd_request_reads_its_newest_entry_before_the_next_one_completes(gloo_world, residency):
    """The newest transferred entry (E - 1) is read right from the first step, whatever the step's
    phase: from slot B of a hot buffer (upstream leaves that slot stale for up to 3 steps,
    docs/deepseek_v4/upstream-contract.md H4) or from a resident request's own rows."""
    for tokens in (4 * (B + 40), 4 * (B + 40) + 1, 4 * (B + 40) + 3):
        rig = Rig(seed=tokens, tp_group=gloo_world, residency=residency)
        req = rig.pd_admit(0, tokens)
        assert resident(rig, req) if residency else rig.coord.residency is None
        read_newest(rig, req)
        for _ in range(3):
            rig.step([req])
        rig.finish(req)
        assert rig.free_counts() == rig.initial


def test_a_pd_request_whose_transfer_never_comes_gives_its_host_rows_back(gloo_world):
    """Preallocated (token ids, host rows), then aborted or failed before admission: SGLang calls
    ``request_finished`` and frees the ids; nothing stays behind. SGLang's PD budget (free C4 rows
    // ``padded_buffer_size``) counts hot buffers; admitting past it is refused by name."""
    rig = Rig(seed=13, tp_group=gloo_world)
    req = rig.pd_admit(0, 1500, arrive=False)
    assert rig.coord.mirror.pool.available_size() < rig.initial[2]
    rig.finish(req)
    assert rig.free_counts() == rig.initial
    padded = rig.coord.padded_buffer_size
    assert rig.alloc.hisparse_attn_allocator.available_size() // padded == 2048 // padded
    taken = rig.alloc.c4.rows.pages.alloc_pages((2048 - padded) // C4_PAGE_ENTRIES + 1)  # other users' rows
    assert rig.alloc.hisparse_attn_allocator.available_size() // padded == 0
    with pytest.raises(HiSparsePluginError, match="no C4 rows for the hot buffer of request pd1"):
        rig.pd_admit(1, 4 * (B + 10))
    rig.alloc.c4.rows.pages.free_pages_(taken)
    rig.finish(SimpleNamespace(req_pool_idx=1, kv=SimpleNamespace(kv_allocated_len=4 * (B + 10))))
    assert rig.free_counts() == rig.initial


def test_a_prefill_short_of_c4_rows_demotes_the_longest_resident_request(gloo_world):
    """Residency (``"residency": true``): two long requests keep all their rows; a third prefill does not
    fit, so the allocator's reclaimer demotes the longest into a hot buffer of its own rows (the
    newest entry copied into slot B) and the prefill proceeds; every read stays exact, every pool
    comes back."""
    rig = Rig(seed=17, tp_group=gloo_world, residency=True)
    a = rig.prefill(0, 2901)  # 725 entries: 12 pages
    b = rig.prefill(1, 2802)  # 700 entries: 11 pages
    rig.coord.collect_ready_reqs()
    assert resident(rig, a) and resident(rig, b) and rig.alloc.c4.rows.room() == 2048 - 23 * 64
    assert rig.alloc.available_size() == 4 * (2048 - 23 * 64 + 2 * (12 * 64 - rig.coord.padded_buffer_size) - 64)
    c = rig.prefill(2, 2603)  # 650 entries: 11 pages > the 9 free
    assert not resident(rig, a) and resident(rig, b)
    read_newest(rig, a)  # entry 724 in slot B, copied there from its own row
    rig.coord.collect_ready_reqs()
    assert resident(rig, c)
    for _ in range(9):
        rig.step([a, b, c])
    for r in (a, b, c):
        rig.finish(r)
    assert rig.free_counts() == rig.initial
    line = rig.coord.idle_report()
    assert "leak=no" in line and "admitted_resident=3 demotions=1" in line, line


def test_a_decode_step_short_of_a_page_demotes_a_resident_request(gloo_world):
    """Two resident requests whose next entry starts a page, and no free C4 row (other users hold
    them): the decode memory check reports no shortfall (a demotion covers it), and the step
    demotes one of them into a hot buffer, whose new entry goes to slot B; the other grows a page."""
    rig = Rig(seed=19, tp_group=gloo_world, residency=True)
    a, b = rig.prefill(0, 3072), rig.prefill(1, 3072)  # 768 entries each: 12 full pages
    rig.coord.collect_ready_reqs()
    assert resident(rig, a) and resident(rig, b)
    taken = rig.alloc.c4.rows.pages.alloc_pages(rig.alloc.c4.rows.room() // 64)
    for _ in range(3):  # tokens 3072..3074: no entry completes
        assert rig.coord.device_rows_short([0, 1], [3072 + _, 3072 + _]) == 0
        rig.step([a, b])
    assert rig.alloc.c4.rows.room() == 0
    assert rig.coord.device_rows_short([0, 1], [3075, 3075]) == 0  # both need a page: a demotion covers it
    rig.step([a, b])  # token 3075 completes entry 768 of each
    assert resident(rig, a) != resident(rig, b)
    demoted = a if not resident(rig, a) else b
    read_newest(rig, demoted)
    for _ in range(6):
        rig.step([a, b])
    rig.alloc.c4.rows.pages.free_pages_(taken)
    for r in (a, b):
        rig.finish(r)
    assert rig.free_counts() == rig.initial
    assert "demotions=1" in rig.coord.idle_report()


def test_without_residency_a_full_device_reports_the_shortfall(gloo_world):
    """Hot buffers only (the V4 default), no free C4 row: a step whose entries start short buffers' pages reports
    the rows it lacks (SGLang then retracts), nothing is demoted."""
    rig = Rig(seed=23, tp_group=gloo_world)
    short = rig.prefill(0, 259)  # 64 entries: the next (token 259 completes it) starts a second page
    rig.coord.collect_ready_reqs()
    taken = rig.alloc.c4.rows.pages.alloc_pages(rig.alloc.c4.rows.room() // 64)
    assert rig.coord.device_rows_short([0], [259]) == 64
    assert rig.coord.device_rows_short([0], [258]) == 0  # no entry completes
    rig.alloc.c4.rows.pages.free_pages_(taken)
    assert rig.coord.device_rows_short([0], [259]) == 0
    rig.finish(short)
    assert rig.free_counts() == rig.initial


def test_metrics_follow_the_c4_counters_and_every_idle_report_publishes_exact_totals(gloo_world, monkeypatch):
    """``--enable-metrics`` on a DeepSeek-V4 server: the seam hands the C4 coordinator an export
    with 584-byte rows; decode steps publish the counters every interval, the idle report exact
    totals and the gauges (hot buffers, residency, host rows)."""
    from patches import metrics as metrics_seam

    published = []

    class Export:
        def __init__(self, labels, row_bytes):
            self.labels, self.row_bytes = labels, row_bytes

        def publish(self, selected, misses, steps, gauges):
            published.append((selected, misses, steps, gauges))

    rig = Rig(seed=29, tp_group=gloo_world, residency=True)
    monkeypatch.setattr(metrics_seam, "PrometheusExport", Export)
    scheduler = SimpleNamespace(hisparse_coordinator=rig.coord, metrics_reporter=SimpleNamespace(enable_metrics=True),
                                server_args=SimpleNamespace(served_model_name="tiny-dsv4"))
    metrics_seam.export_metrics(None, scheduler, 0, 0, None)
    export = rig.coord.report._export[0]
    assert export.row_bytes == 584 and export.labels == {"model_name": "tiny-dsv4", "tp_rank": "0"}
    rig.coord.report._export = (export, 5, rig.coord.report._export[2])  # publish every 5 steps here
    reqs = [rig.prefill(0, 2901), rig.prefill(1, 600)]
    rig.coord.collect_ready_reqs()
    for _ in range(10):
        rig.step(reqs)
    assert [p[2] for p in published] == [5, 10]
    rig.finish(reqs[0])
    line = rig.coord.idle_report()
    selected, misses, steps, gauges = published[-1]
    assert steps == 10 and f"selected={selected} misses={misses}" in line
    assert gauges.resident_requests == 1 and gauges.host_rows_used == 3 * 64  # the 600-token request, decoding
    rig.finish(reqs[1])
