#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (about 5 minutes on one H200): the GPU tests,
# `spotpipe bench gpu`, and `bench pipeline` on that machine's CPUs. Logs go to $OUT (or
# ./gpu-checks). Wheels for packages the machine lacks may wait in .whl/.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; nproc; uptime
  python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"
} 2>&1 | tee "$OUT/env.log"
timeout 150 python3 -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py -s 2>&1 \
  | tee "$OUT/test_gpu.log" | tail -30
timeout 200 python3 -m spotpipe bench gpu --json 2>&1 | tee "$OUT/bench_gpu.log" | tail -c 6000
timeout 120 python3 -m spotpipe bench pipeline --json > "$OUT/bench_pipeline.log" 2>&1
tail -c 1500 "$OUT/bench_pipeline.log"
uptime
