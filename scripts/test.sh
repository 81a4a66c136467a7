#!/usr/bin/env bash
# Installs Glassformer with its test tools and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh test
if [ -f scripts/setup-browser.sh ]; then bash scripts/setup-browser.sh; fi
.venv/bin/ruff check glassformer tests benchmarks
.venv/bin/python -m pytest "$@"
