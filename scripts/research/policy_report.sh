#!/usr/bin/env bash
# The one command for issue 7: (re)generate the selection traces into .traces/ (documents
# already traced with the same settings are skipped) and rebuild docs/policies.md,
# docs/results/policies*.json and the PNG plots.
#
# Uses its own virtualenv outside the repository, keyed by the requirements' hash:
#   ~/.cache/sglang-hisparse/traces-venv-<hash>   (override with HISPARSE_TRACES_VENV)
# Extra arguments are passed to scripts/research/traces/generate.py (e.g. --docs 4 for a quick run).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
req="$repo/scripts/research/traces/requirements.txt"
req_nodeps="$repo/scripts/research/traces/requirements-nodeps.txt"
hash="$(cat "$req" "$req_nodeps" | sha256sum | cut -c1-12)"
venv="${HISPARSE_TRACES_VENV:-$HOME/.cache/sglang-hisparse/traces-venv-$hash}"
if [ ! -f "$venv/.complete" ]; then
  echo "creating $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet -r "$req"
  "$venv/bin/pip" install --quiet --no-deps -r "$req_nodeps"
  touch "$venv/.complete"
fi
cd "$repo"
start=$(date +%s)
"$venv/bin/python" scripts/research/traces/generate.py --out .traces "$@"
echo "generation step: $(( $(date +%s) - start )) s"
"$venv/bin/python" scripts/research/traces/report.py --command "bash scripts/research/policy_report.sh"
