#!/usr/bin/env bash
# Installs Glassformer and runs the main job: generate from the real pretrained SmolLM2-135M.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
.venv/bin/glassformer generate --model smollm2-135m-instruct "The meaning of life is" -n 64 "$@"
