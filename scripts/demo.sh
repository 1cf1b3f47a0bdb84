#!/usr/bin/env bash
# The demo: HiSparse serving a tiny DSA model next to the same server without it; prints per-step
# resolver statistics, pool counts and whether the outputs are identical. Extra args go to the demo.
source "$(dirname "$0")/venv.sh"
cd "$ROOT"
exec "$VPY" -m sglang_hisparse.tools.demo "$@"
