"""Prefix reuse: the radix cache of a HiSparse server (cached prefixes in host rows)."""
