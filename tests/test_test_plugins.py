"""The test-only plugins: they do nothing unless asked, and when asked they do what tests rely on.

* ``hisparse_test_fault``: the wrong-row fault lives outside the serving code and is off by default.
* ``hisparse_upstream_trap``: every function of SGLang's own HiSparse raises once trapped, so a
  server run with the trap on and no trap line proves none of it ran.
* ``hisparse_batch_invariant``: asked, the CPU matrix products of the tiny model's shapes give a row
  the same result at any batch size (what lets a PD pair be compared with a colocated server).
"""

from __future__ import annotations

import warnings

import pytest

from sglang_hisparse_testkit import batch_invariant, fault


class _Registry:
    def __init__(self):
        self.hooks = []

    def register(self, target, hook, hook_type):
        self.hooks.append((target, hook, hook_type))


def test_the_fault_plugin_is_off_by_default_and_checks_its_value(monkeypatch):
    registry = _Registry()
    monkeypatch.delenv(fault.ENV, raising=False)
    fault.register(registry)
    assert registry.hooks == []
    monkeypatch.setenv(fault.ENV, "wrong_rows")
    with pytest.raises(ValueError, match="allowed values are wrong_row"):
        fault.register(registry)
    monkeypatch.setenv(fault.ENV, "wrong_row")
    fault.register(registry)
    assert [h[0] for h in registry.hooks] == [fault.TARGET]


def test_the_upstream_trap_fires_and_our_classes_do_not_trip_it(run_fresh_python):
    result = run_fresh_python(
        """
        import logging
        logging.basicConfig(level=logging.WARNING)
        from sglang.srt.plugins import load_plugins
        load_plugins()
        import sglang.srt.managers.hisparse_coordinator as c
        import sglang.srt.mem_cache.pool_host.hisparse as mixin
        from sglang_hisparse.decode.coordinator import HiSparseCoordinator
        print(c.HiSparseCoordinator is HiSparseCoordinator)
        try:
            mixin.HiSparseHostPoolMixin.alloc_page(object(), 1)
        except AssertionError as e:
            print("trapped:", e)
        """,
        env={"SGLANG_HISPARSE_TRAP_UPSTREAM": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "True",
        "trapped: sglang-hisparse trap: SGLang's own HiSparse "
        "sglang.srt.mem_cache.pool_host.hisparse.HiSparseHostPoolMixin.alloc_page was called",
    ]
    installed = [line for line in result.stderr.splitlines() if "trap: installed on" in line]
    assert len(installed) == 1 and int(installed[0].split("installed on ")[1].split()[0]) >= 40
    assert "trap: sglang.srt.mem_cache.pool_host.hisparse.HiSparseHostPoolMixin.alloc_page called" in result.stderr


def test_the_batch_invariant_plugin_makes_every_row_independent_of_its_batch(monkeypatch):
    """Asked, the plugin turns oneDNN off, and then no bf16 projection gives a row other bits at
    another batch size, at any row of any batch up to 40; unasked, it changes nothing.

    Whether oneDNN itself is batch-variant depends on the CPU and on the process: it was on every
    machine tried when run alone (long reductions, k >= 2048, always; the tiny model's own shapes on
    some), but a CI run of the whole suite once found it invariant on every shape at this point.
    The plugin's guarantee (invariance with it on) is asserted either way; where oneDNN does vary,
    the test also asserts that the plugin is what removes the variance."""
    import torch

    shapes = [(256, 1024), (256, 2048), (256, 160), (128, 384), (512, 256), (2048, 256), (7168, 128), (4096, 2048)]

    def variant_shapes() -> list:
        gen = torch.Generator().manual_seed(0)
        found = []
        for k, n in shapes:
            weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
            x = torch.randn(40, k, generator=gen).bfloat16()
            alone = torch.cat([torch.nn.functional.linear(x[r:r + 1], weight) for r in range(40)])
            if any(not torch.equal(torch.nn.functional.linear(x[:m], weight), alone[:m]) for m in range(2, 41)):
                found.append((k, n))
        return found

    monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)
    monkeypatch.delenv(batch_invariant.ENV, raising=False)
    batch_invariant.register()
    assert torch.backends.mkldnn.enabled, "unasked, the plugin changed nothing"
    with_onednn = variant_shapes()
    monkeypatch.setenv(batch_invariant.ENV, "yes")
    with pytest.raises(ValueError, match="allowed values are 1, 0 or unset"):
        batch_invariant.register()
    monkeypatch.setenv(batch_invariant.ENV, "1")
    batch_invariant.register()
    assert not torch.backends.mkldnn.enabled
    assert variant_shapes() == [], f"batch-variant with the plugin on (oneDNN alone: {with_onednn})"
    if not with_onednn:
        warnings.warn("oneDNN was batch-invariant on every shape in this process: only the plugin's guarantee "
                      "was checked, not that it is what removes a variance")
