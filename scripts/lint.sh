#!/usr/bin/env bash
# Upstream DeepSpeed's pre-commit set over our files and over the files the patch series touches in tree/:
# yapf 0.40.0 and flake8 5.0.4 (.style.yapf and .flake8 carry upstream's values), codespell 2.1.0 with
# upstream's arguments, and the hygiene and local hooks (license lines, deepspeed.comm rather than torch's own
# distributed module, get_accelerator() rather than CUDA tensor calls,
# trailing whitespace, end of file, line endings, JSON, case conflicts) in scripts/precommit.py.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/venv-lint
if [ ! -x "$venv/bin/codespell" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check yapf==0.40.0 flake8==5.0.4 codespell==2.1.0 >/dev/null 2>&1
fi
python3 scripts/fork.py sync >/dev/null
ours=$(git ls-files '*.py')
theirs=$(git -C tree diff --name-only --diff-filter=AM upstream HEAD -- '*.py' | sed 's|^|tree/|')
# every text file of ours except the patch files themselves (diff context carries upstream's whitespace)
texts=$(git ls-files | grep -v -e '^patches/' -e '\.png$')
status=0
"$venv/bin/yapf" --style .style.yapf --diff $ours $theirs || status=1
"$venv/bin/flake8" --config .flake8 $ours $theirs || status=1
"$venv/bin/codespell" --ignore-regex='\\n' --ignore-words-list=youn,unsupport,noe,cann --check-filenames \
  --check-hidden $texts $theirs || status=1
python3 scripts/precommit.py $texts $theirs || status=1
[ $status -eq 0 ] && echo "lint: ok ($(echo $ours $theirs | wc -w) Python files, $(echo $texts $theirs | wc -w) files)"
exit $status
