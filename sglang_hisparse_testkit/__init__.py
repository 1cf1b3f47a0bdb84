"""Test support for sglang-hisparse: test-only SGLang plugins (deterministic dummy weights, the
wrong-row fault, the upstream trap, batch-invariant CPU projections), the one-machine PD test
pair and the resolver case generator. Shipped beside the runtime package for the GPU machine and
CI; ``sglang_hisparse`` never imports it (tests/test_layout.py checks)."""
