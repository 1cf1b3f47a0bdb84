"""Resolvers: turn each layer's selected logical positions into hot-buffer device rows.

``reference`` is pure torch (any device, the oracle); ``cuda`` is the fused kernel.
"""
