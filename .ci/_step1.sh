#!/usr/bin/env bash
# CI: on a clean machine, (1) the README's first command in a fresh virtual environment (so that a package the
# tests' extra installs cannot hide a dependency the main job lacks), then (2) the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. README command 1, copied from the README itself, in a fresh venv (nothing installed before it but pip,
#    as on a new machine).
readme_cmd=$(sed -n '/^# 1\. install/{n;p;}' README.md)
case "$readme_cmd" in
  "pip install torch==2.13.0 setuptools wheel ninja && pip install --no-build-isolation -e . && ktorch generate "*) ;;
  *) echo "CI: README's first command not found or changed shape: '$readme_cmd'" >&2; exit 1 ;;
esac
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
(
  source "$venv/bin/activate"
  echo "CI: README command 1 in a fresh venv: $readme_cmd"
  out=$(bash -c "$readme_cmd" 2>&1) || { echo "$out"; echo "CI: README command 1 failed" >&2; exit 1; }
  echo "$out" | tail -n 3
  echo "$out" | grep -q "^prefill: .* | decode: " || { echo "CI: README command 1 printed no timing line" >&2; exit 1; }
)
rm -rf "$(dirname "$venv")"
