#!/usr/bin/env bash
# Run every notebook (nbdev-test) and check that the committed outputs match what a fresh run shows.
# The run saves outputs into the notebooks, compares, then puts the notebooks back exactly as they were, so a
# developer's working tree is left untouched; `make book` is the same run keeping the outputs.
set -euo pipefail
BIN=${1:-.venv/bin}
ROOT=$(pwd)
snap=$(mktemp -d)
cp -a nbs "$snap/nbs"
restore() { (cd "$snap/nbs" && find . -name '*.ipynb' -exec cp --parents -p {} "$ROOT/nbs/" \;); rm -rf "$snap"; }
trap restore EXIT
"$BIN/nbdev-test" --n-workers 2 --timing --save
"$BIN/nbdev-clean"
"$BIN/python" tools/check_book.py "$snap/nbs" nbs
