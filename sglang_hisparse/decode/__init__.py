"""One decode step: the coordinator SGLang calls, the per-layer resolve, prefetch and pressure.

Built on memory/ (rows) and resolver/ (top-k positions -> rows); never imported by them.
"""
