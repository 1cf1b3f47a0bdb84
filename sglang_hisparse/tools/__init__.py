"""Command-line tools: ``python -m sglang_hisparse.tools.demo`` and ``python -m sglang_hisparse.tools.plan``."""
