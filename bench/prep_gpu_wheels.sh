#!/usr/bin/env bash
# Prepares the Python wheels a bare GPU machine without network lacks, for bench/gpu_check.sh.
# Run on a machine with package access; gpu_check.sh installs them there with --no-index.
#
# The GPU machine to expect (x86-64, CPython 3.12) already has torch, triton, cupy-cuda13x,
# numpy, msgpack, aiohttp, uvloop, prometheus-client, tokenizers, jinja2, safetensors,
# huggingface_hub, transformers, hypothesis and pytest. pdserve imports two more: pyzmq
# (every socket) and llguidance (structured outputs, imported on first use); neither has
# a dependency of its own on CPython. Versions come from constraints.txt.
#   usage: bench/prep_gpu_wheels.sh          (PYTHON=... for the pip to use; WHEEL_DIR, default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
DEST="${WHEEL_DIR:-.whl}"
PACKAGES=(pyzmq llguidance)
# pip matches a manylinux tag exactly: list every glibc level an x86-64 wheel may carry.
PLATFORMS=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
           manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

mkdir -p "$DEST"
for name in "${PACKAGES[@]}"; do
  pin="$(grep -iE "^${name}==" constraints.txt | head -n 1 || true)"
  [ -n "$pin" ] || { echo "prep_gpu_wheels: $name has no pin in constraints.txt" >&2; exit 1; }
  # One version of each package: two wheels of one name stop the whole install there.
  rm -f "$DEST/${name}"-*.whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "$pin"
done

# Every wheel is for CPython 3.12 (or the stable ABI) on x86-64, one per package, and
# brings no requirement the GPU machine would have to find elsewhere.
status=0
for whl in "$DEST"/*.whl; do
  base="$(basename "$whl")"
  case "$base" in
    *-cp312-cp312-*x86_64*.whl | *-abi3-*x86_64*.whl | *-py3-none-any.whl) ;;
    *) echo "prep_gpu_wheels: $base is not a CPython 3.12 x86-64 wheel" >&2; status=1 ;;
  esac
  needs="$("$PY" - "$whl" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:")]
pypy = ("platform_python_implementation", "implementation_name")  # markers for PyPy only
print("; ".join(r for r in reqs if "extra ==" not in r and not any(m in r for m in pypy)))
PYEOF
)"
  [ -z "$needs" ] || { echo "prep_gpu_wheels: $base requires: $needs" >&2; status=1; }
done
ls -l "$DEST"
exit "$status"
