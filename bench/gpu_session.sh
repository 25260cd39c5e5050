#!/usr/bin/env bash
# Issue 36's checks on a lent GPU machine in one `run` call: build nodekv there, then the measurement the issue still
# waits on first, so that a call cut short keeps it: node mass's cost on the 1.5B and 8B shapes, three ways of a fresh
# prefill side by side (--fresh-mass kernel,sdpa,kernel/64x32x4x2: the one-pass Triton kernel, SDPA's output and
# log-sum-exp then the Triton mass pass, or the kernel at the tiles that were fastest with mass for 512 rows of 1.5B
# shapes on an H100), then the CUDA tests and the kernel bench; every log lands in $OUT. A session has 15 minutes of
# device time, the machine's start included, so this is one call of about 8 minutes (on an H100, 2026-11-26: build
# ~40 s, 1.5B engine bench ~2.5 min, 8B ~2 min, tests 103 s, triton_gpu ~40 s). Still open: node mass at 1.38x an 8K
# prefill on 1.5B shapes (target 1.25x), measured before the one pass stopped touching its accumulator in every key
# block (2026-12-07); `triton_ops.FRESH_PREFILL_MASS` (and `MASS_TILES`) then take the faster way
# that holds the bf16 mass error. The tile sweep (`triton_gpu --tiles`) is left out: it ran on the H100
# (results/gpu_h100.md).
# Each step has its own timeout, so that one that hangs leaves the others' logs.
#
# The machine has PyTorch, Triton and transformers but not gguf, which the loader imports, and its setuptools may
# predate pyproject's SPDX license (>= 77): fetch both wheels here first
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl gguf==0.19.0 'setuptools>=77'   # (.whl/: git-ignored)
# then: run(command="bash bench/gpu_session.sh", carry=[".whl"], timeout_s=590), and give_back.
set -o pipefail
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
# the C++ extension is built for this machine's Python (the CPU kernels; the CUDA path does not use them)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$out/build.log" 2>&1 || {
    tail -30 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
ways=kernel,sdpa,kernel/64x32x4x2
timeout 190 python3 -m nodekv.bench.gpu_engine --preset qwen2.5-1.5b --fresh-mass $ways 2>&1 \
    | tee "$out/gpu_engine-qwen2.5-1.5b.md"
timeout 130 python3 -m nodekv.bench.gpu_engine --preset llama-3.1-8b --no-check --prompts 2048,8192 --batch 16 \
    --decode 32 --repeats 3 --fresh-mass $ways 2>&1 | tee "$out/gpu_engine-llama-3.1-8b.md"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_triton_cuda.py tests/engine/test_device.py \
    2>&1 | tee "$out/tests.log" | tail -15
timeout 60 python3 -m nodekv.bench.triton_gpu 2>&1 | tee "$out/triton_gpu.md"
