#!/usr/bin/env bash
# Issue 36's checks on a lent GPU machine in one `run` call: build nodekv there, run the CUDA tests, then the kernel
# and engine benchmarks against HF transformers; every log lands in $OUT. On an H200 (2026-11-26) the build took 39 s,
# the tests 90 s, triton_gpu ~40 s, the 1.5B engine bench ~2 min and the 8B one ~1.5 min: about 6.5 min with the
# machine's start. Not yet run: the tile sweep (`triton_gpu --tiles`, up to ~3.5 min) and the 1.5B engine bench
# with node mass summed by one-hot products (`--mass-sums dot`, ~2 min), both for the node-mass cost: about 12 min
# in all, so a 15-minute device budget holds one run (give the steps a rerun's time only if one fails). Each step has
# its own timeout, so that one that hangs leaves the others' logs. Results: results/gpu_h200.md.
#
# The machine has PyTorch, Triton and transformers but not gguf, which the loader imports: fetch its wheel here first
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl gguf==0.19.0      # (.whl/ is git-ignored via .git/info/exclude)
# then: run(command="bash bench/gpu_session.sh", carry=[".whl"]).
set -o pipefail
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
# the C++ extension is built for this machine's Python (the CPU kernels; the CUDA path does not use them)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$out/build.log" 2>&1 || {
    tail -30 "$out/build.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_triton_cuda.py tests/engine/test_device.py \
    2>&1 | tee "$out/tests.log" | tail -15
timeout 90 python3 -m nodekv.bench.triton_gpu 2>&1 | tee "$out/triton_gpu.md"
timeout 220 python3 -m nodekv.bench.triton_gpu --tiles --repeats 20 2>&1 | tee "$out/triton_tiles.md"
timeout 180 python3 -m nodekv.bench.gpu_engine --preset qwen2.5-1.5b 2>&1 | tee "$out/gpu_engine-qwen2.5-1.5b.md"
timeout 180 python3 -m nodekv.bench.gpu_engine --preset qwen2.5-1.5b --mass-sums dot 2>&1 \
    | tee "$out/gpu_engine-qwen2.5-1.5b-dot.md"
timeout 120 python3 -m nodekv.bench.gpu_engine --preset llama-3.1-8b --no-check --prompts 2048 --batch 16 --repeats 3 \
    2>&1 | tee "$out/gpu_engine-llama-3.1-8b.md"
