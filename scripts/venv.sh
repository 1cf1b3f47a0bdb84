# Sourced by scripts/test.sh and scripts/demo.sh: create or reuse the project's virtualenv and
# install the project into it. The venv lives outside the clone, keyed by a hash of the Python
# version and the dependency pins in pyproject.toml, so repeated runs on one machine reuse it and
# a fresh machine builds it from nothing. The project is installed editable (code changes need no
# reinstall); it is reinstalled only when pyproject.toml changes (entry points, packages). pip's
# output goes to $VENV/install.log and is shown only when an install fails. Sets VENV and VPY.
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
PROJECT_HASH=$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)
pip_logged() {
  if ! "$VPY" -m pip "$@" >>"$VENV/install.log" 2>&1; then
    echo "[venv] pip $* failed; its output:"; tail -n 60 "$VENV/install.log"; exit 1
  fi
}
# mooncake's transfer engine (a test dependency: a CPU PD pair moving real KV) links libibverbs.so.1,
# which a machine without RDMA may lack: Debian's libibverbs1 is installed when we are root, else we
# say what to install (the PD tests then fail with mooncake's import error).
ensure_mooncake_libs() {
  "$VPY" -c "import mooncake.engine" 2>/dev/null && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[venv] installing libibverbs1 (mooncake's transfer engine links it)"
    { apt-get install -y -q libibverbs1 || { apt-get update -q && apt-get install -y -q libibverbs1; }; } \
      >>"$VENV/install.log" 2>&1 || echo "[venv] apt-get install libibverbs1 failed (see $VENV/install.log)"
  fi
  "$VPY" -c "import mooncake.engine" 2>/dev/null \
    || echo "[venv] mooncake's transfer engine does not load ($("$VPY" -c "import mooncake.engine" 2>&1 | tail -1)); install libibverbs1"
}
if [ ! -f "$VENV/.complete" ]; then
  echo "[venv] creating $VENV (SGLang 0.5.17 and torch: a few minutes the first time)"
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
  pip_logged install -q --upgrade pip
  pip_logged install -q -e "$ROOT[test]"
  "$VPY" -c "import sglang, torch, sglang_hisparse" || { echo "[venv] install failed"; exit 1; }
  echo "$ROOT $PROJECT_HASH" > "$VENV/.project"
  touch "$VENV/.complete"
elif [ "$(cat "$VENV/.project" 2>/dev/null)" != "$ROOT $PROJECT_HASH" ]; then
  echo "[venv] reusing $VENV; installing this checkout (pyproject.toml changed or another clone)"
  pip_logged install -q --no-deps -e "$ROOT"
  echo "$ROOT $PROJECT_HASH" > "$VENV/.project"
else
  echo "[venv] reusing $VENV"
fi
ensure_mooncake_libs
