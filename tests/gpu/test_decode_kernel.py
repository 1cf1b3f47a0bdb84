"""The decode step's id kernels (kernels/decode.cuh) against their torch twins, on fresh random
inputs with the outputs poisoned first. Skips without CUDA.

* ``decode_ids``: batches of 1 to 3000 requests (several 1024-thread chunks), page sizes 1 and 64,
  int32 and int64 ``last_loc``, any share of page starts; also a free list shorter than the page
  starts (those past it get -1).
* ``map_pages``: distinct logical pages mapped to row pages, the resident marks set, nothing else
  touched.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from sglang_hisparse.memory.allocator import map_new_pages_torch  # noqa: E402
from sglang_hisparse.memory.paging import decode_ids_torch  # noqa: E402
from sglang_hisparse.resolver.jit import decode_module  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
POISON = -7


def random_step(rng: random.Random, bs: int, page: int, start_share: float):
    """``last_loc`` of a batch where about ``start_share`` of the requests end their page."""
    ends = [rng.random() < start_share for _ in range(bs)]
    last = [rng.randrange(1, 5000) * page + (page - 1 if e else rng.randrange(0, max(page - 1, 1)))
            for e in ends]
    if page == 1:  # every new position starts a page
        last = [rng.randrange(1, 5000) for _ in range(bs)]
    starts = [b for b, x in enumerate(last) if (x + 1) % page == 0]
    return last, starts


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_decode_ids_matches_its_twin(dtype):
    rng = random.Random(3)
    cases = 0
    for bs in (1, 2, 31, 32, 33, 1023, 1024, 1025, 2048, 3000):
        for page in (1, 64):
            for share in (0.0, 0.03, 0.5, 1.0):
                last, starts = random_step(rng, bs, page, share)
                last_loc = torch.tensor(last, dtype=dtype, device=CUDA)
                free = torch.randperm(10_000, device=CUDA).to(torch.int64) + 1
                pages = free[: len(starts)]
                out = torch.full((bs,), POISON, dtype=torch.int64, device=CUDA)
                decode_module().decode_ids(last_loc, pages, out, page)
                want = decode_ids_torch(last_loc, starts, pages if starts else None, page)
                assert torch.equal(out, want), (bs, page, share, dtype)
                cases += 1
    assert cases == 80


def test_decode_ids_gives_minus_one_past_the_free_pages():
    page = 64
    last_loc = torch.tensor([63, 64, 127, 191, 5], dtype=torch.int32, device=CUDA)  # starts at 0, 2, 3
    pages = torch.tensor([7, 9], dtype=torch.int64, device=CUDA)
    out = torch.full((5,), POISON, dtype=torch.int64, device=CUDA)
    decode_module().decode_ids(last_loc, pages, out, page)
    assert out.tolist() == [7 * 64, 65, 9 * 64, -1, 6]


def test_decode_ids_refuses_bad_arguments():
    out = torch.empty(3, dtype=torch.int64, device=CUDA)
    with pytest.raises(Exception, match="one id per request"):
        decode_module().decode_ids(torch.zeros(2, dtype=torch.int32, device=CUDA),
                                   torch.zeros(1, dtype=torch.int64, device=CUDA), out, 64)
    with pytest.raises(Exception, match="free_pages"):
        decode_module().decode_ids(torch.zeros(3, dtype=torch.int32, device=CUDA),
                                   torch.zeros(1, dtype=torch.int32, device=CUDA), out, 64)


def test_map_pages_matches_its_twin():
    rng = random.Random(5)
    page, logical_pages_total, rows_total = 64, 4096, 2048
    for n in (1, 2, 127, 128, 129, 1000):
        l2d = torch.randint(-5, 10**6, (logical_pages_total * page + page + 1,), dtype=torch.int64, device=CUDA)
        marks = torch.randint(0, 2, (logical_pages_total + 2,), dtype=torch.uint8, device=CUDA)
        logical = torch.tensor(rng.sample(range(1, logical_pages_total), n), dtype=torch.int64, device=CUDA)
        rows = torch.tensor(rng.sample(range(1, rows_total), n), dtype=torch.int64, device=CUDA)
        want_l2d, want_marks = l2d.clone(), marks.clone()
        map_new_pages_torch(logical, rows, want_l2d, want_marks, page)
        decode_module().map_pages(logical, rows, l2d, marks, page)
        assert torch.equal(l2d, want_l2d) and torch.equal(marks, want_marks), n
