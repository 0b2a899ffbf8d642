#!/usr/bin/env bash
# GPU checks for kv_transfer (CUDA IPC): the CUDA tests, then the GPU transfer benchmark
# (CUDA IPC next to device memcpy, shared memory for reference), then an end-to-end serving
# run (bench/gpu_serve.py: Llama-3-8B-shaped random-weight model in bfloat16, 1 prefill +
# 1 decode worker; prefill tok/s, decode tok/s at batch 1 and 32, decode as a fraction of
# the HBM-bandwidth limit). Needs an NVIDIA GPU, numpy/pyzmq/msgpack/pytest, cupy
# (cupy-cuda12x), torch with CUDA, and ~17 GB of disk for the model (written once, reused).
# The whole script is bounded to under 10 minutes (the serving run gets what is left).
#   usage: bench/gpu_check.sh            (PYTHON=/path/to/python to pick an interpreter;
#          GPU_SERVE_JSON=path for the serving run's JSON, default /tmp/gpu_serve.json)
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"

nvidia-smi -L || { echo "gpu_check: no NVIDIA GPU visible" >&2; exit 1; }
if ! "$PY" -c "import cupy" 2>/dev/null; then
  echo "gpu_check: cupy missing, trying pip install cupy-cuda12x" >&2
  "$PY" -m pip install -q cupy-cuda12x || { echo "gpu_check: cannot install cupy" >&2; exit 1; }
fi
# Fail loudly instead of letting the tests skip on a machine that should have a GPU.
"$PY" -c "import sys; from kv_transfer.cuda_ipc import cuda_available; sys.exit(not cuda_available())" \
  || { echo "gpu_check: cupy cannot use a CUDA device" >&2; exit 1; }

echo "== CUDA IPC tests"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs tests/kv_transfer/test_cuda_ipc.py

echo "== GPU transfer benchmark"
timeout 240 "$PY" -m bench.kv_transfer --transports cuda shm --runs 5

# Expected on an H200: ~1 min to write the 16 GB of bfloat16 weights (first run only; a
# cheap tiled fill, then disk), ~1 min for both workers to load them, ~1 min of requests.
echo "== End-to-end serving (Llama-3-8B shape, bfloat16)"
"$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" \
  || { echo "gpu_check: torch cannot use a CUDA device" >&2; exit 1; }
# SECONDS: bash's count since the script started. On timeout gpu_serve gets SIGTERM and
# stops its workers and gateway (<= 40 s); SIGKILL 50 s later: at most 590 s in all.
left=$((540 - SECONDS))
[ "$left" -ge 120 ] || { echo "gpu_check: only ${left}s left of the 10 minutes for the serving run" >&2; exit 1; }
timeout -k 50 "$left" "$PY" -m bench.gpu_serve --shape llama3-8b --dtype bfloat16 --device cuda \
  --batches 1,32 --measure-hbm --output-json "${GPU_SERVE_JSON:-/tmp/gpu_serve.json}"
