"""What the Triton attention kernels compile to for a CUDA GPU, on any machine (no GPU needed): per tile config,
the attention pass without node mass and with it summed in the pass, and the mass pass alone (`_attn_mass`, after
SDPA or the attention pass): the registers a thread uses, the bytes it spills (the cubin's stack), its shared
memory, and how many asynchronous copies Triton's software pipeliner put in the key loop (0: each key block waits
for its own loads). These explain a kernel's speed before any GPU time is spent.

The kernel is specialised as a launch specialises it: pointers and strides divisible by 16, a stride of 1 a
constant (without that, the same tiles spill about 1 KB a thread). Triton's bundled ptxas builds the cubin and its
cuobjdump reads the resources. The numbers are Triton's of this machine (a GPU machine's Triton may differ).

    nodekv bench triton_compiled [--arch 90] [--dtype bfloat16] [--head-dim 128] [--group 6] [--nodes 32]
"""
from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import tempfile
from pathlib import Path

# sm_80 (Ampere) to sm_90 (Hopper): the bf16/fp16 dots need sm_80, and sm_90 is the one measured (H100/H200);
# a capability Triton's ptxas does not know aborts inside LLVM
ARCHS = (80, 86, 89, 90)
TILES = [(64, 64, 4, 3), (64, 64, 8, 3), (64, 32, 4, 3), (32, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2),
         (64, 32, 4, 2)]
POINTERS = {"Q": "*{dt}", "KP": "*{dt}", "VP": "*{dt}", "O": "*{dt}", "L": "*fp32", "BT": "*i32", "NB": "*i32",
            "MB": "*fp32", "ENDS": "*i32", "NODE": "*i32", "M": "*fp32"}
KERNELS = ["none", "one pass", "mass pass"]  # the attention pass without mass, with it, and `_attn_mass` alone
# strides that are 0, 1 or of no known alignment at some launch
UNALIGNED = {"stride_bt", "stride_ms", "stride_mh", "stride_os", "stride_ls", "stride_ln", "stride_lh"}


def compile_attention(arch: int, dtype: str, hd: int, group: int, nodes: int, tiles: tuple[int, int, int, int],
                      kernel: str) -> dict:
    """One of KERNELS for sm_<arch> with `tiles` = (BLOCK_M, BLOCK_N, warps, stages): `_attn_fwd` without mass
    ("none") or with one-pass mass over `nodes` nodes ("one pass"), or `_attn_mass` ("mass pass")."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nodekv.kernels.triton_attention import _attn_fwd, _attn_mass

    block_m, block_n, warps, stages = tiles
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]
    const = dict(G=group, HD=hd, PAGE=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(hd),
                 DOT_PRECISION="ieee" if dtype == "float32" else None, stride_mj=1)
    if kernel == "mass pass":
        fn = _attn_mass
    else:
        fn = _attn_fwd
        const.update(STORE_LSE=False, MASS=kernel == "one pass", MASS_SPLITS=False, PER_SEQ=False,
                     N_PAD=max(16, triton.next_power_of_2(nodes)))
    signature, attrs = {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in const:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name].format(dt=short)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
            if name.startswith("stride") and name not in UNALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    found = {key: int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK")}
    return {"registers": found["REG"], "spilled": found["STACK"], "shared": compiled.metadata.shared,
            "async_copies": compiled.asm["ttgir"].count("async_copy_global_to_local")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, choices=ARCHS, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=6, help="query heads per KV head (qwen2.5-1.5b: 6)")
    p.add_argument("--nodes", type=int, default=32)
    a = p.parse_args(argv)
    import triton

    print(f"sm_{a.arch}, Triton {triton.__version__}, {a.dtype}, hd {a.head_dim}, GQA group {a.group}, "
          f"{a.nodes} nodes")
    print("| tiles (BLOCK_M, BLOCK_N, warps, stages) | node mass | registers | spilled bytes | shared memory, KB "
          "| async copies |")
    print("|---|---|---:|---:|---:|---:|")
    for tiles in TILES:
        for kernel in KERNELS:
            r = compile_attention(a.arch, a.dtype, a.head_dim, a.group, a.nodes, tiles, kernel)
            print(f"| {tiles} | {kernel} | {r['registers']} | {r['spilled']} | {r['shared'] / 1024:.1f} "
                  f"| {r['async_copies']} |")


if __name__ == "__main__":
    main()
