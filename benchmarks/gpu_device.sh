#!/usr/bin/env bash
# One device run of benchmarks/gpu_device.py: install the wheels staged in .whl/ (the
# device machine has no registry), then run it; everything lands in $OUT.
#   bash benchmarks/gpu_device.sh [gpu_device.py options]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 KVWIRE_NO_EXTENSIONS=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 benchmarks/gpu_device.py --out "$OUT" "$@" 2>&1 | tee "$OUT/run.log"
