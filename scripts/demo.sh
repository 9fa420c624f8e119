#!/usr/bin/env bash
# The fork's main job: set up .venv if needed, then train a small model with ZeRO 1/2/3 on several
# CPU ranks and report what every rank did. Arguments go to scripts/demo.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
exec .venv/bin/python scripts/demo.py "$@"
