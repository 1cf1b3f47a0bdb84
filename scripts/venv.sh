# Sourced by scripts/test.sh and scripts/demo.sh: create or reuse the project's virtualenv and
# install the project into it. The venv lives outside the clone, keyed by a hash of the Python
# version and the dependency pins in pyproject.toml, so repeated runs on one machine reuse it and
# a fresh machine builds it from nothing. Sets VENV and VPY.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE_PYTHON=${SGLANG_HISPARSE_PYTHON:-python3}
PIN_HASH=$("$BASE_PYTHON" - "$ROOT/pyproject.toml" <<'PY'
import hashlib, json, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
pins = [sys.version.split()[0], project["dependencies"], project.get("optional-dependencies", {})]
print(hashlib.sha256(json.dumps(pins, sort_keys=True).encode()).hexdigest()[:16])
PY
)
VENV=${SGLANG_HISPARSE_VENV:-$HOME/.cache/sglang-hisparse/venv-$PIN_HASH}
VPY="$VENV/bin/python"
pip_quiet() { "$VPY" -m pip "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if [ ! -f "$VENV/.complete" ]; then
  echo "[venv] creating $VENV (SGLang 0.5.17 and torch: a few minutes the first time)"
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
  pip_quiet install -q --upgrade pip
  pip_quiet install -q -e "$ROOT[test]"
  "$VPY" -c "import sglang, torch, sglang_hisparse" || { echo "[venv] install failed"; exit 1; }
  touch "$VENV/.complete"
else
  echo "[venv] reusing $VENV"
  pip_quiet install -q --no-deps -e "$ROOT"
fi
