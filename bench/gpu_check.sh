#!/usr/bin/env bash
# GPU checks for kv_transfer (CUDA IPC): the CUDA tests, then the GPU transfer benchmark
# (CUDA IPC next to device memcpy, shared memory for reference). Needs an NVIDIA GPU,
# numpy/pyzmq/msgpack/pytest and cupy (cupy-cuda12x). Finishes well under 10 minutes.
#   usage: bench/gpu_check.sh            (PYTHON=/path/to/python to pick an interpreter)
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
