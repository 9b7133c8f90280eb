#!/usr/bin/env bash
# The checks that need a GPU, in one short run on a machine with CUDA and PyTorch installed:
# tests/test_cuda.py (with its tables), the suite's tests crossed with the cuda device,
# scripts/profile_cuda.py and benchmarks/cuda_speed.py. Logs, the speed table and a tarball of the
# profile go to ${OUT:-cuda-check}; about 4 minutes on an H200.
#
#     bash scripts/check_cuda.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-cuda-check}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
pytest=(python3 -m pytest -q -rfE -p no:cacheprovider -o addopts="")
timeout "${TEST_SECONDS:-150}" "${pytest[@]}" -s tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
timeout "${CROSSED_SECONDS:-120}" "${pytest[@]}" -k cuda --ignore=tests/test_cuda.py tests 2>&1 \
    | tee "$out/cuda_crossed.log"
timeout "${PROFILE_SECONDS:-150}" python3 scripts/profile_cuda.py --repeats 3 --out "$out/profile" 2>&1 \
    | tee "$out/profile.log"
timeout "${SPEED_SECONDS:-180}" python3 benchmarks/cuda_speed.py --repeats 9 --out "$out" 2>&1 | tee "$out/speed.log"
if [ -d "$out/profile" ]; then
    tar czf "$out/profile.tgz" -C "$out" profile
    if [ "$(stat -c %s "$out/profile.tgz")" -gt 15000000 ]; then  # the traces can be large: keep the rest
        tar czf "$out/profile.tgz" -C "$out" --exclude='*trace*' profile
    fi
    rm -rf "$out/profile"
fi
