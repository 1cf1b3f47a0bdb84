#!/usr/bin/env bash
# Run the test suite (what CI runs): create or reuse the venv, install .[test], run pytest.
# Extra arguments go to pytest, e.g. scripts/test.sh -k config -x
source "$(dirname "$0")/venv.sh"
cd "$ROOT"
start=$(date +%s)
set +e
"$VPY" -m pytest "$@"
rc=$?
echo "[test] pytest exit $rc after $(( $(date +%s) - start ))s"
exit $rc
