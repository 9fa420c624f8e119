#!/usr/bin/env bash
# Upstream DeepSpeed's formatting and lint settings (yapf 0.40.0, flake8 5.0.4; .style.yapf and .flake8
# carry upstream's values) over our Python files and over the files the patch series touches in tree/.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/venv-lint
if [ ! -x "$venv/bin/yapf" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check yapf==0.40.0 flake8==5.0.4 >/dev/null 2>&1
fi
python3 scripts/fork.py sync >/dev/null
ours=$(git ls-files '*.py')
theirs=$(git -C tree diff --name-only --diff-filter=AM upstream HEAD -- '*.py' | sed 's|^|tree/|')
status=0
"$venv/bin/yapf" --style .style.yapf --diff $ours $theirs || status=1
"$venv/bin/flake8" --config .flake8 $ours $theirs || status=1
[ $status -eq 0 ] && echo "lint: ok ($(echo $ours $theirs | wc -w) files)"
exit $status
