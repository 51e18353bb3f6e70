#!/usr/bin/env bash
# keyq as a package index would take it and a user would install it: build the sdist and the
# wheel (the wheel from the sdist, so the sdist must hold everything), `twine check` them, then
# install the wheel alone, with its default dependencies and no extra, into a fresh venv and
# use it on the real services (scripts/installed_wheel_check.py). Everything happens in a
# temporary folder that is removed at the end: nothing is left in the tree.
#
# Usage: scripts/package_check.sh   (PYTHON: the dev venv's python, with build and twine)
set -euo pipefail

cd "$(dirname "$0")/.."
root=$PWD
PYTHON=${PYTHON:-.venv/bin/python}
work=$(mktemp -d "${TMPDIR:-/tmp}/keyq-package.XXXXXX")
trap 'rm -rf "$work"' EXIT

say() { echo "keyq package: $*"; }

# From a copy of the tracked files (of the tree, outside git), so the build's keyq.egg-info
# lands in the copy.
mkdir "$work/src-copy"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$work/src-copy"
else
    tar --exclude=./.venv --exclude=./build -cf - . | tar -xf - -C "$work/src-copy"
fi
"$PYTHON" -m build --outdir "$work/dist" "$work/src-copy" >"$work/build.log" 2>&1 || {
    tail -40 "$work/build.log" >&2
    say "python -m build failed" >&2
    exit 1
}
say "built $(cd "$work/dist" && echo *)"
"$PYTHON" -m twine check --strict "$work"/dist/*

"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "$work"/dist/*.whl
say "installed the wheel: $("$work/venv/bin/keyq" --version)"
"$work/venv/bin/keyq" settings >/dev/null
# Run from the checkout, so a .env there counts as for every command: the script's own folder
# (scripts/) heads sys.path, and it holds no keyq, so only the installed one is importable.
"$work/venv/bin/python" "$root/scripts/installed_wheel_check.py"
