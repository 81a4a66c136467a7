#!/usr/bin/env bash
# Creates .venv (once) and installs Glassformer into it, with the extras named in $1 (e.g. "test").
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch is pinned to the CPU build so that a fresh machine never pulls a multi-GB CUDA build.
spec="."
if [ -n "${1:-}" ]; then spec=".[$1]"; fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e "$spec"
