"""The typed --hisparse-config: defaults, the model's top_k, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_hisparse.config import (
    KNOWN_KEYS,
    HiSparseConfig,
    HiSparseConfigError,
    parse_hisparse_config,
)


def test_defaults_follow_the_model_top_k():
    """With no keys, B = 2 x the model's index_topk; ratio 2; block 960."""
    cfg = parse_hisparse_config(None, model_index_topk=64)
    assert cfg == HiSparseConfig(
        top_k=64, device_buffer_size=128, host_to_device_ratio=2, swap_in_block_size=960
    )


def test_defaults_without_a_model_top_k_match_upstream():
    cfg = parse_hisparse_config("{}")
    assert (cfg.top_k, cfg.device_buffer_size) == (2048, 4096)


def test_model_index_topk_wins_over_the_key():
    cfg = parse_hisparse_config('{"top_k": 512}', model_index_topk=2048)
    assert cfg.top_k == 2048 and cfg.device_buffer_size == 4096


def test_all_keys_round_trip():
    raw = {
        "top_k": 64,
        "device_buffer_size": 192,
        "host_to_device_ratio": 4,
        "swap_in_block_size": 256,
        "resolver": "reference",
        "skip_io": True,
        "stats_log_interval": 4,
        "wait_for_staging": True,
        "indexshare_prefetch": False,
        "residency": True,
        "residency_watermark": 0.125,
        "promotion_interval": 8,
        "replacement": "reuse",
        "slot_map": True,
        "max_device_buffer_size": 384,
    }
    cfg = parse_hisparse_config(json.dumps(raw))
    assert cfg.to_json_dict() == {**raw, "query_rows": 1}  # query_rows: derived, not a key


def test_query_rows_comes_from_the_server_not_from_the_config():
    with pytest.raises(HiSparseConfigError, match="unknown key\\(s\\) query_rows"):
        parse_hisparse_config('{"query_rows": 4}')
    cfg = parse_hisparse_config(None, model_index_topk=64, query_rows=3)
    assert (cfg.query_rows, cfg.device_buffer_size) == (3, 4 * 64)
    parse_hisparse_config('{"device_buffer_size": 192}', model_index_topk=64, query_rows=3)
    with pytest.raises(HiSparseConfigError, match="must be in \\[3 x top_k=192"):
        parse_hisparse_config('{"device_buffer_size": 191}', model_index_topk=64, query_rows=3)


def test_residency_is_on_by_default_and_off_with_speculation():
    """Residency is the default (a server without memory pressure then holds its requests as without
    HiSparse); with speculation (N > 1 query rows) it defaults to off, and the launcher refuses an
    explicit true there (tests/test_server_checks.py)."""
    assert parse_hisparse_config(None).residency is True
    assert parse_hisparse_config('{"residency": false}').residency is False
    assert parse_hisparse_config(None, query_rows=2).residency is False
    assert parse_hisparse_config('{"residency": true}', query_rows=2).residency is True  # refused by the launcher


def test_slot_map_is_off_by_default():
    assert parse_hisparse_config(None).slot_map is False
    assert parse_hisparse_config('{"slot_map": true}').slot_map is True


def test_replacement_defaults_to_lru():
    assert parse_hisparse_config(None).replacement == "lru"
    assert parse_hisparse_config('{"replacement": "reuse"}').replacement == "reuse"


def test_config_is_frozen():
    cfg = parse_hisparse_config(None)
    with pytest.raises(Exception):
        cfg.top_k = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"bogus": 1}', "unknown key(s) bogus; known keys: " + ", ".join(KNOWN_KEYS)),
        ('{"device_buffer_size": "4096"}', 'invalid device_buffer_size="4096": must be an integer'),
        ('{"device_buffer_size": 4096.0}', "invalid device_buffer_size=4096.0: must be an integer"),
        ('{"device_buffer_size": true}', "invalid device_buffer_size=true: must be an integer"),
        ('{"device_buffer_size": 63}', "invalid device_buffer_size=63: must be in [top_k=64, 32767]"),
        ('{"device_buffer_size": 32768}', "invalid device_buffer_size=32768: must be in [top_k=64, 32767]"),
        ('{"swap_in_block_size": 100}', "invalid swap_in_block_size=100: must be a multiple of 32 in [32, 1024]"),
        ('{"swap_in_block_size": 0}', "invalid swap_in_block_size=0: must be a multiple of 32 in [32, 1024]"),
        ('{"swap_in_block_size": 1056}', "invalid swap_in_block_size=1056: must be a multiple of 32 in [32, 1024]"),
        ('{"host_to_device_ratio": 0}', "invalid host_to_device_ratio=0: must be an integer >= 1"),
        ('{"host_to_device_ratio": 1.5}', "invalid host_to_device_ratio=1.5: must be an integer"),
        ('{"resolver": "fast"}', 'invalid resolver="fast": must be one of auto, reference, cuda'),
        ('{"skip_io": 1}', "invalid skip_io=1: must be true or false"),
        ('{"wait_for_staging": "yes"}', 'invalid wait_for_staging="yes": must be true or false'),
        ('{"residency": "on"}', 'invalid residency="on": must be true or false'),
        ('{"residency_watermark": 0.75}', "invalid residency_watermark=0.75: must be a number in [0, 0.5]"),
        ('{"residency_watermark": true}', "invalid residency_watermark=true: must be a number in [0, 0.5]"),
        ('{"promotion_interval": -1}', "invalid promotion_interval=-1: must be an integer >= 0"),
        ('{"replacement": "lfu"}', 'invalid replacement="lfu": must be one of lru, reuse'),
        ('{"replacement": true}', "invalid replacement=true: must be one of lru, reuse"),
        ('{"slot_map": 1}', "invalid slot_map=1: must be true or false"),
        ('{"stats_log_interval": -1}', "invalid stats_log_interval=-1: must be an integer >= 0 (0 = off)"),
    ],
)
def test_bad_input_gets_a_one_line_message_naming_the_key(raw, fragment):
    with pytest.raises(HiSparseConfigError) as info:
        parse_hisparse_config(raw, model_index_topk=64)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message
    assert message.startswith("--hisparse-config: ")


def test_a_path_reads_the_json_file_it_names_and_says_so(tmp_path, caplog):
    path = tmp_path / "hisparse.json"
    path.write_text('{\n  "device_buffer_size": 200,\n  "residency": false\n}\n')
    with caplog.at_level("INFO", logger="sglang_hisparse.config"):
        cfg = parse_hisparse_config(str(path), model_index_topk=64)
    assert (cfg.device_buffer_size, cfg.residency) == (200, False)
    assert f"--hisparse-config read from {path}" in caplog.text
    assert cfg == parse_hisparse_config('{"device_buffer_size": 200, "residency": false}', model_index_topk=64)


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "is neither inline JSON (which starts with '{{') nor an existing file"),
        ("{not json", "(file {path}): not valid JSON (Expecting property name enclosed in double quotes at line 1"),
        ('{"device_buffer_size": 7}', "invalid device_buffer_size=7: must be in [top_k=64, 32767]"),
        ('{"bogus": 1}', "unknown key(s) bogus"),
        ("[]", "expected a JSON object, got []"),
    ],
)
def test_a_bad_config_file_gets_a_one_line_message(tmp_path, content, fragment):
    path = tmp_path / "hisparse.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(HiSparseConfigError) as info:
        parse_hisparse_config(str(path), model_index_topk=64)
    message = str(info.value)
    assert fragment.format(path=path) in message and "\n" not in message, message
    assert message.startswith("--hisparse-config")


def test_a_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(HiSparseConfigError, match=f"cannot read '{tmp_path}': IsADirectoryError"):
        parse_hisparse_config(str(tmp_path), model_index_topk=64)


@given(
    top_k=st.integers(1, 16383),
    extra=st.integers(0, 16384),
    ratio=st.integers(1, 64),
    block_warps=st.integers(1, 32),
)
def test_every_legal_combination_parses(top_k, extra, ratio, block_warps):
    buffer_size = min(top_k + extra, 32767)
    raw = json.dumps(
        {
            "device_buffer_size": buffer_size,
            "host_to_device_ratio": ratio,
            "swap_in_block_size": 32 * block_warps,
        }
    )
    cfg = parse_hisparse_config(raw, model_index_topk=top_k)
    assert cfg.top_k <= cfg.device_buffer_size <= 32767
    assert cfg.swap_in_block_size % 32 == 0
