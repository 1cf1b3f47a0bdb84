"""patches/pd_bootstrap_check.py: a request without its bootstrap address is refused alone on a
decode instance served by either of our coordinators (DSA or DeepSeek-V4); anything else goes to
SGLang's ``DecodePreallocQueue.add`` unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from patches import pd_bootstrap_check
from sglang_hisparse.decode.c4_coordinator import C4Coordinator
from sglang_hisparse.decode.coordinator import HiSparseCoordinator


def queue_with(coordinator):
    streamed = []
    scheduler = SimpleNamespace(hisparse_coordinator=coordinator,
                                output_streamer=SimpleNamespace(stream_output=lambda reqs, lp: streamed.extend(reqs)))
    return SimpleNamespace(scheduler=scheduler), streamed


def request(**bootstrap):
    return SimpleNamespace(rid="r1", return_logprob=False, finished_reason=None, **bootstrap)


@pytest.mark.parametrize("coordinator_class", [HiSparseCoordinator, C4Coordinator])
def test_a_request_without_bootstrap_host_is_aborted_alone(coordinator_class):
    queue, streamed = queue_with(object.__new__(coordinator_class))
    added = []

    def original(q, req, is_retracted=False, **kw):
        added.append(req)

    lost = request(bootstrap_host=None, bootstrap_room=7)
    assert pd_bootstrap_check.add(original, queue, lost) is None
    assert not added and streamed == [lost]
    assert lost.finished_reason.status_code == 400 and "without bootstrap_host" in lost.finished_reason.message
    paired = request(bootstrap_host="127.0.0.1", bootstrap_room=7)
    pd_bootstrap_check.add(original, queue, paired)
    retracted = request(bootstrap_host=None, bootstrap_room=None)  # a retracted request coming back
    pd_bootstrap_check.add(original, queue, retracted, is_retracted=True)
    assert added == [paired, retracted] and streamed == [lost]


def test_servers_without_our_coordinator_run_sglangs_add_unchanged():
    queue, streamed = queue_with(None)
    added = []
    lost = request(bootstrap_host=None, bootstrap_room=None)
    pd_bootstrap_check.add(lambda q, req, is_retracted=False: added.append(req), queue, lost)
    assert added == [lost] and not streamed and lost.finished_reason is None
