#!/usr/bin/env bash
# The demo: load the plugin in a real SGLang process, show the parsed config and the hooks in force.
source "$(dirname "$0")/venv.sh"
cd "$ROOT"
exec "$VPY" -m sglang_hisparse.demo "$@"
