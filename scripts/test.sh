#!/usr/bin/env bash
# Run the test suite: create or reuse the venv, install .[test], run pytest.
#   bash scripts/test.sh           the default tier (what CI runs through .ci/run)
#   bash scripts/test.sh --full    every test: adds the tests marked full (the long soak, the
#                                  exhaustive cases) and x4 hypothesis budgets (tests/conftest.py)
# Other arguments go to pytest, e.g. scripts/test.sh -k config -x
source "$(dirname "$0")/venv.sh"
cd "$ROOT"
tier=default
for arg in "$@"; do
  [ "$arg" = "--full" ] && tier=full
done
echo "[test] tier: $tier"
start=$(date +%s)
set +e
"$VPY" -m pytest "$@"  # --full is tests/conftest.py's option
rc=$?
echo "[test] pytest ($tier tier) exit $rc after $(( $(date +%s) - start ))s"
exit $rc
