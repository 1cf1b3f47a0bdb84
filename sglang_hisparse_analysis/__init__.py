"""The replacement-policy study: policies, a numpy simulator and a replay of recorded selection
traces (docs/policies.md). Analysis only; ``sglang_hisparse`` never imports it."""
