#!/usr/bin/env bash
# Create .venv with torch 2.13.0 (CPU) and the fork installed editable (`pip install -e .`), plus the
# test tools. Idempotent and quick when nothing changed. Used by scripts/demo.sh and scripts/test.sh.
# Another torch in another venv: LOCKSTEP_TORCH=2.14.1 LOCKSTEP_VENV=.venv-2.14 bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${LOCKSTEP_VENV:-.venv}
TORCH=${LOCKSTEP_TORCH:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"
# What the installed fork was built from; reinstall when any of it changes.
want=$( (echo "torch $TORCH"; cat pyproject.toml upstream.toml requirements-test.txt scripts/lockstep_build.py patches/series \
       $(sed 's|^|patches/|' patches/series) 2>/dev/null) | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.lockstep-installed" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing torch $TORCH, test tools and the fork into $VENV (log: $VENV/setup.log)"
  log="$VENV/setup.log"
  pipi() { "$py" -m pip install --disable-pip-version-check "$@" >>"$log" 2>&1 || { tail -25 "$log"; exit 1; }; }
  : > "$log"
  pipi "torch==$TORCH" $(case "$TORCH" in 2.[012].*) echo "numpy<2" ;; esac)
  echo "torch==$TORCH" > "$VENV/constraints.txt"  # the test tools must not move torch
  case "$TORCH" in 2.[012].*) echo "numpy<2" >> "$VENV/constraints.txt" ;; esac  # built against NumPy 1
  if [ "$TORCH" = 2.13.0 ]; then
    pipi -r requirements-test.txt -c "$VENV/constraints.txt"
  else  # transformers and accelerate need a recent torch: their tests skip where they do not install
    pipi -r <(grep -v -E '^(transformers|accelerate)' requirements-test.txt) -c "$VENV/constraints.txt"
    "$py" -m pip install --disable-pip-version-check -r requirements-test.txt -c "$VENV/constraints.txt" >>"$log" 2>&1 ||
      echo "setup: transformers/accelerate do not install beside torch $TORCH: their tests skip"
  fi
  python3 scripts/fork.py sync >/dev/null
  pipi -e .
  echo "$want" > "$VENV/.lockstep-installed"
else
  python3 scripts/fork.py sync >/dev/null
fi
"$py" -c "import deepspeed, sys; print('setup: deepspeed', deepspeed.__version__, 'in', sys.prefix)" 2>/dev/null
