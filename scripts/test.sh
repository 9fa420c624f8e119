#!/usr/bin/env bash
# The test suite: set up .venv if needed, then run pytest over tests/ on CPU ranks (gloo).
# Extra arguments go to pytest (e.g. `-m slow` for the large world-size cases, `-k harness`).
# LOCKSTEP_TORCH / LOCKSTEP_VENV: another torch in another venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
cd tests
VENV=${LOCKSTEP_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="../$VENV" ;; esac
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q "$@"
