"""The SGLang seams: the only modules that register hooks into SGLang.

Each module names one upstream target, the hook type, and the SGLang version its contract was
checked against, and exposes ``register(registry)``. The plugin entry point
(:mod:`sglang_hisparse.serving.plugin`) decides which seams to register. Imports run one way:
plugin -> patches -> core (``sglang_hisparse.*``).
"""
