#!/usr/bin/env bash
# The prepared GPU run: one script for a bare NVIDIA machine without network (sized for
# one H200), under 10 minutes, every result written under $OUT.
#
#   with package access:  bench/prep_gpu_wheels.sh          (wheels the machine lacks -> .whl/)
#   on the GPU machine:   OUT=/some/dir bash bench/gpu_check.sh      (default OUT: ./gpu_out)
#
# Phases, in this order, each bounded by `timeout` and each run whatever happened to the
# one before (a failure is recorded, never the end of the run):
#   wheels     .whl/*.whl installed with --no-index into a target dir put on PYTHONPATH
#   native     the optional C extensions built for this interpreter (setup.py build_ext)
#   env        versions, the device, a two-process CUDA IPC probe (bench/gpu_env.py)
#   gpu_tests  pytest -m gpu: the CUDA IPC transport and the staging path, Triton attention
#              parity in bf16, decode graphs against eager steps, pinned step metadata,
#              chunk attention through flash attention's log-sum-exp, FlashInfer
#              parity where flashinfer is installed (not on the expected machine nor in
#              .whl/: that case skips with its reason)
#   hf_equiv   pytest -m gpu of tests/engine/test_hf_equivalence.py (bf16 and fp16 on CUDA
#              against transformers); skipped with a note where transformers is missing
#   kv         KV transfer GB/s (bench/kv_transfer.py, Llama-3-8B KV of 2,048 tokens): CUDA
#              IPC against a device-to-device memcpy, and device pools over tcp (staging)
#   attention  Triton decode attention against gather + SDPA, batch 64 x 4k, bf16
#   serve      gateway + 1 prefill + 1 decode worker on the one GPU, Llama-3-8B shape in
#              bf16 (bench/gpu_serve.py): prefill at 2,048 tokens as a fraction of 989
#              TFLOP/s (H200 SXM dense bf16, datasheet), decode at batch 1 and 32 as a
#              fraction of the 4.8 TB/s HBM roofline; gets the time the others left
# then bench/gpu_summary.py writes $OUT/summary.json (every phase's status, the results,
# the issue's targets met or not) and prints its table. $OUT holds three files:
# summary.json, phases.tsv and gpu_check.log (everything printed, the serving stack's log
# tail included). Exit status 0 when no phase failed, timed out or ran out of time.
#
# Environment: PYTHON (default python3), OUT, GPU_CHECK_BUDGET_S (the whole run, default
# 570), GPU_CHECK_WHEELS (default .whl). GPU_CHECK_DRY_RUN=1 prints each phase's command
# instead of running it (CI runs this on CPU); GPU_CHECK_DRY_FAIL="kv env" makes those
# phases fail in a dry run.
set -uo pipefail  # no -e: a failed phase is recorded and the next one runs
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
BUDGET="${GPU_CHECK_BUDGET_S:-570}"
WHEELS="${GPU_CHECK_WHEELS:-.whl}"
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"  # phase outputs; summary.json has them
SITE="$WORK/site"
PHASES="$OUT/phases.tsv"
SUMMARY_S=30     # kept for the summary at the end
SERVE_MIN_S=270  # kept for `serve` by every phase before it
MIN_PHASE_S=15   # a phase with less time than this is not started

record() {  # name status rc seconds limit note
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$PHASES"
}

dry_run() {  # a dry run's stand-in for a phase's command
  case " ${GPU_CHECK_DRY_FAIL:-} " in
    *" $1 "*) echo "dry run: $1 fails"; return 3 ;;
  esac
  echo "dry run: $1 ok"
}

# phase NAME LIMIT_S KEEP_S GRACE_S CMD...: CMD for at most LIMIT_S seconds (SIGTERM, then
# SIGKILL GRACE_S later, all within LIMIT_S), leaving KEEP_S of the budget to later phases.
phase() {
  local name=$1 limit=$2 keep=$3 grace=$4
  shift 4
  local left=$((BUDGET - SUMMARY_S - keep - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit < MIN_PHASE_S + grace)); then
    echo "== $name: not started, ${left}s left"
    record "$name" no_time - 0 "$limit" "not started: ${left}s left"
    return
  fi
  echo "== $name (at ${SECONDS}s, limit ${limit}s): $*"
  local t0=$SECONDS rc status=ok
  if [ "$DRY" = 1 ]; then
    dry_run "$name"
    rc=$?
  else
    timeout -k "$grace" "$((limit - grace))" "$@"
    rc=$?
  fi
  if ((rc == 124 || rc == 137)); then status=timeout; elif ((rc != 0)); then status=failed; fi
  echo "== $name: $status (exit $rc, $((SECONDS - t0))s)"
  record "$name" "$status" "$rc" "$((SECONDS - t0))" "$limit" ""
}

skip() {  # name note: a phase that cannot apply here
  echo "== $1: skipped: $2"
  record "$1" skipped - 0 0 "$2"
}

main() {
  : > "$PHASES"
  echo "gpu_check: $(date -u +%FT%TZ), budget ${BUDGET}s, OUT=$OUT, python $PY, dry run $DRY"
  command -v nvidia-smi > /dev/null && nvidia-smi -L

  local wheels=("$WHEELS"/*.whl)
  if [ -e "${wheels[0]}" ]; then
    phase wheels 90 "$SERVE_MIN_S" 10 "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  else
    skip wheels "no wheels in $WHEELS (bench/prep_gpu_wheels.sh makes them)"
  fi
  # The repo itself too: worker processes are started from other directories' view.
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  # Kernel caches under $WORK unless set: a home that is read-only (as in the GPU image)
  # makes cupy's and Triton's first compile fail, in every phase and worker.
  export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$WORK/cupy}" TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$WORK/triton}"
  phase native 60 "$SERVE_MIN_S" 10 "$PY" setup.py -q build_ext --inplace
  phase env 60 "$SERVE_MIN_S" 10 "$PY" -m bench.gpu_env --output-json "$WORK/env.json"
  phase gpu_tests 150 "$SERVE_MIN_S" 10 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu \
    --junitxml "$WORK/gpu_tests.xml" tests/kv_transfer/test_cuda_ipc.py \
    tests/kv_transfer/test_cuda_device.py tests/engine/test_triton_attention.py \
    tests/engine/test_cuda_graphs.py tests/engine/test_step_staging.py \
    tests/engine/test_mask_free_prefill.py tests/engine/test_flashinfer_attention.py
  if "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('transformers') is None)"; then
    phase hf_equiv 90 "$SERVE_MIN_S" 10 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu \
      --junitxml "$WORK/hf_equiv.xml" tests/engine/test_hf_equivalence.py
  else
    skip hf_equiv "transformers is not installed: no Hugging Face reference to compare with"
  fi
  phase kv 90 "$SERVE_MIN_S" 10 "$PY" -m bench.kv_transfer --shapes llama3-8b --tokens 2048 \
    --runs 5 --transports cuda cuda-tcp --output-json "$WORK/kv.json"
  phase attention 60 "$SERVE_MIN_S" 10 "$PY" -m bench.attention_kernels --device cuda \
    --batch 64 --context 4096 --dtype bfloat16 --output-json "$WORK/attention.json"
  # gpu_serve stops its stack on SIGTERM (<= 40 s), hence the grace. TMPDIR: its stack log.
  phase serve 600 0 50 env TMPDIR="$WORK" "$PY" -m bench.gpu_serve --shape llama3-8b \
    --dtype bfloat16 --device cuda --batches 1,32 --prefill-len 2048 --prefill-requests 16 \
    --measure-hbm --hbm-gbps 4800 --peak-tflops 989 --output-json "$WORK/serve.json"
  for f in "$WORK"/pdserve-gpu-serve-*.log; do
    [ -e "$f" ] && { echo "== serving stack log (last 150 lines of $f)"; tail -n 150 "$f"; }
  done

  echo "== summary"
  timeout -k 5 "$((SUMMARY_S - 5))" "$PY" -m bench.gpu_summary --phases "$PHASES" \
    --work "$WORK" --output-json "$OUT/summary.json"
}

main 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$status"
