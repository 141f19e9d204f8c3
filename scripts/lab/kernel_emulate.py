"""Run the kernels of metal_shaders on the CPU, one warp (or block) at a time, against their
references: a check of their index arithmetic and row invariance where there is no GPU.

Each kernel body, behind the prelude of the backend chosen (`--backend cuda`, the default, or
`metal`: exactly what `mx.fast.cuda_kernel` / `mx.fast.metal_kernel` are handed), is compiled by
g++ with a small shim for that backend's names: a warp (SIMD group) is 32 threads, a shuffle
trades values through a barrier, `__ldg`, `uint4` and Metal's address spaces are plain C++, and
Metal's math is the C library's. float32, and bfloat16 emulated in software (as the GPUs round it)
for the add-norm, gated-norm, MoE combine and GLU kernels. It checks, per kernel,
that the R-row call equals each row's 1-row call bit for bit and stays within 1e-4 of the
float32 reference, including column tails, 8-bit packing and a routed expert picked by more
rows than one block takes (affine, and MXFP4 in each decode form). The GLU forms of the matrix
kernels (gate and up in one launch, silu(gate)·up written; dense, affine 4 and 8 bits, routed
experts) run in float32 and bfloat16: for R = 1..8 each row (pick) equals its 1-row call bit for
bit and stays within GLU_TOLERANCE of the reference, and each product, written alone, is the
plain kernel's bits. The column-mapped forms (output column j from weight row map[j], each
segment of columns written contiguous: dense and affine 4 and 8 bits, float32 and bfloat16)
equal, for R = 1..8 and their segments side by side, each row's 1-row call and the plain
kernel's call with its columns gathered by the map bit for bit (`--only mapped` runs these
alone). The GDN window kernels (metal_shaders/gdn_window.py) run the same way: for T = 1..8,
a T-row call equals T chained 1-row calls bit for bit and stays within 1e-5 (relative) of the
reference, at the 80B model's heads (Hk 16, Hv 32, Dk = Dv = 128), the demo
model's (2, 4, 64, 64) and a batch of 2; so do the Mamba-2 window kernels
(metal_shaders/mamba2_window.py), at Nemotron-3-Nano's heads (H 64, P 64, G 8, N 128), a
Granite-like single group without a conv bias, and a batch of 2. The attention window kernel
(metal_shaders/attention_window.py) runs a whole block at a time (its warps share memory): for
T = 1..8 each row of a T-row call equals its 1-row call over the same cache buffer bit for bit
and stays within 1e-5 (relative) of the reference, with D = 256 and 64, rows whose first sees
L = 1, 7, 300 and 5000 cells (one kernel at every length), grouped query heads and a batch of 2,
and the sink kernel with a ring window among its cases; then, with splits of SPLIT_CELLS =
1,024 (the default), L = 1020 (a window's call takes the splits where some rows' 1-row calls
do not) and 5000, and the sink kernel at 1020 with sinks above every score. The router window kernel
(metal_shaders/router_window.py) runs a block per row too: for R = 1..8 each row of an R-row call
(plain, and as the router's columns of wider rows) equals its 1-row call bit for bit, picks the reference's experts
(descending, ties to the lower index: the logits include exact ties) and weighs them within 1e-6
(relative) of it, at E = 512, k = 10 (Qwen3-Next-80B), E = 48, k = 2 (the demo model), 1024/16
and 130/8, with float32 and bfloat16-valued logits. The add-norm kernel (metal_shaders/add_norm.py)
runs a block per row, in float32 and in bfloat16 (in software): for R = 1..8 each row of an
R-row call equals its 1-row call bit for bit (h and the normed h), h equals MLX's x + y bit for
bit and the normed h stays within add_norm.TOLERANCE of the reference, at H = 2048
(Qwen3-Next-80B) and 130. The gated-norm kernel (metal_shaders/gated_norm.py) runs a block per
(row, group), the gate, weight and output in float32 and in bfloat16 (in software): for R = 1..8
each row of an R-row call equals its 1-row call bit for bit and stays within gated_norm.TOLERANCE
of the layers' own ops, in GDN's form at Qwen3-Next-80B's heads (Hv 32, Dv 128, the weight (Dv,)
and tiled), 3 x 130 and 1 x 37, and in Mamba-2's (the gate first) at Nemotron-H's groups
(8 x 1024) and 2 x 1000. The MoE combine kernel
(metal_shaders/moe_combine.py) runs a thread at a time (its threads never meet), with float32 and
bfloat16 picks (bfloat16 emulated as the GPUs round it): for R = 1..8 each row equals its 1-row
call bit for bit and stays within one output rounding plus 1e-6 (of the row's largest) of the
reference, at H = 2048, 131 and 1000, k = 1, 4, 10 and 16, renormalising or not, with a shared
expert's gated term or without, with the residual added or without (the residual variants equal
MLX's add of the residual to the plain variants' output bit for bit; `--only combine` runs these
alone). The attention-prep kernel (metal_shaders/attention_prep.py) runs a block per (row, head),
in float32 and in bfloat16 (in software): for R = 1..8 at window offsets 0 and 4093 each row t
equals its 1-row call at offset p + t bit for bit (q, k, v and the gate) and stays within
attention_prep.TOLERANCE of the head's own ops and cpu_rope, at Qwen3-Next-80B's attention (16 q
heads, 2 kv heads, D 256, output gate, partial rotary 64, q/k norm), a plain layout (no gate,
full rotary, no norm), 3/1 x 130 and 2/1 x 512. The embedding kernel (metal_shaders/embed_rows.py)
runs a thread at a time: at 2, 4 and 8 bits, groups of 32, 64 and 128, float32 and bfloat16 (in
software), for R = 1..8 each row of an R-token call equals its 1-token call and the reference
(`nn.QuantizedEmbedding`'s MLX ops) bit for bit, a (2, 4) batch gives the same rows, and
out-of-range ids (int32, uint32 and int64) give zero rows (`--only embed` runs these alone).
The matrix kernels' tail (a reduce-scatter over the warp) gives, for every kind, R = 1..8,
float32 and bfloat16, and 2, 4 and 8 columns a warp, the bits of the per-value xor butterfly it
replaced (`BUTTERFLY_TAIL`; `--only tails` runs these alone). The pool's copies
(metal_shaders/pooled.py) run a thread at a time: for 3 to 16 values, `join` of int32 pieces gives
the values and `split` of int32, uint32 and float32 values gives pieces of their bits (negative
ints, -0.0, infinities, NaN; `--only pooled`). The argmax kernels (metal_shaders/argmax_rows.py)
run a block at a time: in float32 and bfloat16, at a width with a short last chunk and at
151,936, the tokens of 8 rows (ties across lanes and chunks, -inf, NaN, the largest first and
last), of 3 and of each row alone are MLX's CUDA argmax's (`--only argmax`).
Not a speed figure; needs g++ with C++20. Takes about 15-20 minutes on a 2-core machine (most of it the attention checks).

`--nvcc` instead compiles every body for sm_90 with nvcc, wrapped as mx.fast.cuda_kernel wraps
it (a __global__ function in namespace mlx::core::cu, the template values as constants), in
float32 and bfloat16: what NVRTC would refuse shows here without a GPU; per kernel it prints
ptxas's registers, stack and spills and the PTX's warp shuffles (`--butterfly-tail`: the matrix
bodies with their old tail, for comparison).

    python -m scripts.lab.kernel_emulate
    python -m scripts.lab.kernel_emulate --backend metal
    python -m scripts.lab.kernel_emulate --nvcc
    python -m scripts.lab.kernel_emulate --only mapped
    python -m scripts.lab.kernel_emulate --only embed
    python -m scripts.lab.kernel_emulate --only tails
    python -m scripts.lab.kernel_emulate --only pooled
    python -m scripts.lab.kernel_emulate --only argmax
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from metal_shaders import (add_norm, argmax_rows, attention_prep, attention_window, backends, embed_rows, gated_norm,
                           gdn_window, mamba2_window, moe_combine, pooled, router_window)
from metal_shaders import columns as columns_
from metal_shaders import rows_matvec as kernels

SHIM_BASE = r"""
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <math.h>
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
struct uint4 { unsigned int x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
template <typename V> inline V __ldg(const V* p) { return *p; }
inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
// fp16 -> float in software (subnormals included), for the preludes' strata_f16lo / hi
inline float strata_emulated_f16(unsigned short b) {
    const int e = (b >> 10) & 31, m = b & 1023;
    const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                  : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(static_cast<float>(1024 + m), e - 25);
    return (b & 0x8000) ? -v : v;
}
struct __half { unsigned short bits; };
inline __half __ushort_as_half(unsigned short b) { return {b}; }
inline float __half2float(__half h) { return strata_emulated_f16(h.bits); }
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim;
#define __device__
#define __forceinline__ inline
"""
SHIM = SHIM_BASE + r"""
std::barrier<>* warp_barrier;
float warp_slots[32];
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int lane = threadIdx.x & 31;
    warp_barrier->arrive_and_wait();
    warp_slots[lane] = v;
    warp_barrier->arrive_and_wait();
    return warp_slots[lane ^ off];
}
inline void __syncwarp() { warp_barrier->arrive_and_wait(); }
inline void __syncthreads() { std::abort(); }  // a warp at a time: a body that needs its block runs as one
"""
# Metal's names over a CUDA shim: the attributes are the CUDA shim's indices, address spaces are
# plain memory (threadgroup arrays static, as blocks run one after another), the math is the C
# library's. The CUDA float math names are renamed first: the Metal prelude defines them, which
# would clash with <math.h>.
METAL_SHIM = r"""
#define threadgroup static
#define thread_position_in_threadgroup threadIdx
#define threadgroup_position_in_grid blockIdx
#define threads_per_threadgroup blockDim
#define expf strata_metal_expf
#define fmaf strata_metal_fmaf
#define fmaxf strata_metal_fmaxf
#define fabsf strata_metal_fabsf
#define sqrtf strata_metal_sqrtf
#define rsqrtf strata_metal_rsqrtf
#define log1pf strata_metal_log1pf
#define sinf strata_metal_sinf
#define cosf strata_metal_cosf
using ushort = unsigned short;
struct half { unsigned short bits; operator float() const { return strata_emulated_f16(bits); } };
template <typename To, typename From> inline To as_type(From v) { To t; std::memcpy(&t, &v, sizeof t); return t; }
namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline float exp(float x) { return std::exp(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fabs(float x) { return std::fabs(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float log(float x) { return std::log(x); }
inline float sin(float x) { return std::sin(x); }
inline float cos(float x) { return std::cos(x); }
inline float ldexp(float x, int e) { return std::ldexp(x, e); }
inline float simd_shuffle_xor(float v, ushort offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
inline void threadgroup_barrier(mem_flags) { __syncthreads(); }
inline void simdgroup_barrier(mem_flags) { __syncwarp(); }
}
"""


def program(shim: str, backend: str, header: str, params: list[str], consts: str, body: str) -> str:
    """The C++ of one kernel for `backend` as MLX would build it (prelude, header, body), over `shim`."""
    if backend == backends.METAL:
        shim += METAL_SHIM
    return (shim + backends.header(backend, header)
            + f"void kernel({', '.join(params)}) {{\n{consts}\n{backends.source(backend, body)}\n}}\n")
SLURP = r"""
static std::vector<char> slurp(const char* path) {
    std::vector<char> bytes; char buf[65536]; size_t n; FILE* f = fopen(path, "rb");
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) bytes.insert(bytes.end(), buf, buf + n);
    fclose(f); return bytes;
}
"""
# A block's threads run at once (the routed-experts body stages its picks behind a block barrier).
# The threads are made once and run the blocks in turn, meeting at the block barrier after each,
# so blocks run one after another as before (a thread costs more to start than a small block).
MAIN = SLURP + r"""
int main(int argc, char** argv) {
    std::vector<std::vector<char>> in;
    for (int i = 0; i < NUM_INPUTS; ++i) in.push_back(slurp(argv[1 + i]));
    const int gx = atoi(argv[1 + NUM_INPUTS]), gy = atoi(argv[2 + NUM_INPUTS]), tx = atoi(argv[3 + NUM_INPUTS]);
    std::vector<OUT_T> out(atol(argv[4 + NUM_INPUTS]));
    std::memset(out.data(), 0xFF, out.size() * sizeof(OUT_T));  // NaN until written
    blockDim.x = tx;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (int w = 0; w < tx / 32; ++w) warps.emplace_back(new std::barrier<>(32)), warp_barriers[w] = warps.back().get();
    std::barrier<> block(tx); block_barrier = &block;
    std::vector<std::thread> threads;
    for (int i = 0; i < tx; ++i) threads.emplace_back([&, i] {
        for (int by = 0; by < gy; ++by) for (int bx = 0; bx < gx; ++bx) {
            threadIdx.x = i; blockIdx.x = bx; blockIdx.y = by; CALL;
            block.arrive_and_wait();
        }
    });
    for (auto& t : threads) t.join();
    FILE* f = fopen(argv[5 + NUM_INPUTS], "wb"); fwrite(out.data(), sizeof(OUT_T), out.size(), f); fclose(f);
}
"""
# name: (kernel parameters as MLX generates them for float32 inputs, body, extra template lines); at
# bfloat16 every float array but the gather's is the model's dtype (x, dense weights, scales, biases).
KINDS = {
    "dense": (["const int32_t* dims", "const float* x", "const float* w"], kernels.DENSE, "using TW = float;"),
    "quantized": (["const int32_t* dims", "const float* x", "const uint32_t* w", "const float* scales",
                   "const float* biases"], kernels.QUANTIZED, "using TS = float;"),
    "gather": (["const int32_t* dims", "const float* x", "const uint32_t* w", "const float* scales",
                "const float* biases", "const uint32_t* idx"], kernels.GATHER_QUANTIZED,
               "using TS = float; using TI = uint32_t;"),
    "gather_mxfp4": (["const int32_t* dims", "const float* x", "const uint32_t* w", "const uint8_t* scales",
                      "const uint32_t* idx"], kernels.GATHER_MXFP4, "using TI = uint32_t;"),
    "dense_glu": (["const int32_t* dims", "const float* x", "const float* w", "const float* w_up"], kernels.DENSE_GLU,
                  "using TW = float;"),
    "quantized_glu": (["const int32_t* dims", "const float* x", "const uint32_t* w", "const float* scales",
                       "const float* biases", "const uint32_t* w_up", "const float* scales_up", "const float* biases_up"],
                      kernels.QUANTIZED_GLU, "using TS = float;"),
    "gather_glu": (["const int32_t* dims", "const float* x", "const uint32_t* w", "const float* scales",
                    "const float* biases", "const uint32_t* w_up", "const float* scales_up", "const float* biases_up",
                    "const uint32_t* idx"], kernels.GATHER_QUANTIZED_GLU,
                   f"using TS = float; using TI = uint32_t; constexpr int UNROLL = {kernels.GLU_UNROLL};"),
}
KINDS.update({f"{plain}_mapped": ([*KINDS[plain][0], "const uint32_t* col_map"], body, KINDS[plain][2])
              for plain, body in (("dense", kernels.DENSE_MAPPED), ("quantized", kernels.QUANTIZED_MAPPED))})
KIND_HEADERS = {"gather_mxfp4": kernels.HEADER + kernels.MXFP4_HEADER}  # else kernels.HEADER (the GLU kinds: + Emulator.glu)
GLU_KINDS = {"dense_glu": "dense", "quantized_glu": "quantized", "gather_glu": "gather"}  # each with its plain kind
MAPPED_KINDS = {"dense_mapped": "dense", "quantized_mapped": "quantized"}  # likewise


GXX = ["g++", "-std=c++20", "-O1", "-Wno-unknown-pragmas", "-pthread"]
_binaries: dict[str, Path] = {}  # source hash -> a binary built by this process
_cache_dir: Path | None = None


def _cache() -> Path:
    """This process's build cache (removed at exit): the binaries by source hash, and the standard
    headers every shim includes, precompiled once (parsing them was ~1.2 s of each ~2 s g++ call)."""
    global _cache_dir
    if _cache_dir is None:
        _cache_dir = Path(tempfile.mkdtemp(prefix="strata-kernel-emulate-cache-"))
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
        includes = {line for line in (SHIM_BASE + SHIM_BLOCK).splitlines() if line.startswith("#include")}
        (_cache_dir / "std.h").write_text("".join(f"{line}\n" for line in sorted(includes)))
        # no check: without a usable .gch, g++ reads std.h's text instead, to the same program
        subprocess.run([*GXX, "-x", "c++-header", str(_cache_dir / "std.h"), "-o", str(_cache_dir / "std.h.gch")])
    return _cache_dir


def compile_program(path: Path, source: str) -> None:
    """Write `source` beside `path` (.cpp) and build it with g++ into the executable `path`; a
    source this process built before is copied, not built again. `-include std.h` adds only
    headers the source includes itself (their include guards make its own #includes no-ops), so
    the program is the same one: same flags, same floating-point code."""
    path.with_suffix(".cpp").write_text(source)
    digest = hashlib.sha256(source.encode()).hexdigest()
    if digest not in _binaries:
        built = _cache() / digest
        subprocess.run([*GXX, "-include", str(_cache() / "std.h"), str(path.with_suffix(".cpp")), "-o", str(built)],
                       check=True)
        _binaries[digest] = built
    shutil.copy2(_binaries[digest], path)


def write_inputs(workdir: Path, prefix: str, inputs: list) -> list[str]:
    """Each input's bytes (arrays as C-ordered buffers, bytes as they are) in its own file under
    `workdir`, named prefix0, prefix1, ...: the emulated kernel's argv. Returns the paths."""
    names = []
    for i, a in enumerate(inputs):
        names.append(str(workdir / f"{prefix}{i}"))
        Path(names[-1]).write_bytes(a if isinstance(a, bytes) else np.ascontiguousarray(np.asarray(a)).tobytes())
    return names


class Emulator:
    """The matrix kernels of rows_matvec on the CPU, in float32 or bfloat16 (in software, BF16_SHIM:
    x, dense weights, scales, biases and the output in the dtype). `glu`: the GLU kinds' joining
    of gate and up (kernels.GLU_HEADER; a check may swap in one that writes the gate or the up alone)."""

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}
        self.glu = kernels.GLU_HEADER
        self.kinds = KINDS  # kind -> (parameters, body, constants); a check may swap in other bodies

    def _binary(self, kind: str, rows: int, cols: int, bits: int, gs: int, more: tuple = (), dtype=mx.float32) -> Path:
        header = KIND_HEADERS.get(kind, kernels.HEADER) + (self.glu if kind in GLU_KINDS else "")
        key = (kind, rows, cols, bits, gs, *more, dtype, header)
        if key not in self.built:
            t = EMULATED_TYPES[dtype][0]
            params, body, extra = self.kinds[kind]
            params = [p.replace("const float* ", f"const {t}* ") for p in params]
            consts = f"using T = {t}; {extra.replace('float', t)} constexpr int ROWS = {rows}; constexpr int COLS = {cols};"
            if not kind.startswith("dense"):
                consts += f" constexpr int BITS = {bits}; constexpr int GS = {gs};"
            consts += "".join(f" constexpr int {name} = {value};" for name, value in more)
            args = ", ".join(f"({p.rsplit(' ', 1)[0]})in[{i}].data()" for i, p in enumerate(params))
            source = (program(SHIM_BLOCK + BF16_SHIM, self.backend, header, [*params, f"{t}* out"], consts, body)
                      + MAIN.replace("NUM_INPUTS", str(len(params))).replace("OUT_T", t)
                      .replace("CALL", f"kernel({args}, out.data())"))
            path = self.dir / "_".join(str(k) for k in key[:5])
            path = path.with_name(path.name + "".join(f"_{name}{value}" for name, value in more)
                                  + f"_{t}_{len(self.built)}")
            compile_program(path, source)
            self.built[key] = path
        return self.built[key]

    def launch(self, kind: str, inputs: list, *, rows: int, blocks_y: int, N: int, out_rows: int, bits: int = 0,
               gs: int = 0, cols: int | None = None, more: dict | None = None, dtype=mx.float32) -> np.ndarray:
        """`more`: further template values (name: int), e.g. the MXFP4 kernel's DECODE. `cols`:
        output columns a warp (default kernels.COLS, the GLU kinds' kernels.GLU_COLS). At
        bfloat16 the inputs are raw bits (`raw_bits`); the output comes widened to float32 (exact)."""
        if kind in GLU_KINDS:
            config = kernels.glu_launch_config(rows, N, cols=cols)
        else:
            config = kernels.launch_config(rows, N, cols=cols or kernels.COLS)
        compiled = dict(config["template"])
        binary = self._binary(kind, compiled["ROWS"], compiled["COLS"], bits, gs, tuple(sorted((more or {}).items())),
                              dtype)
        names = write_inputs(self.dir, "in", inputs)
        threads = config["threadgroup"][0]
        grid = (config["grid"][0] // threads, blocks_y)
        if (more or {}).get("PICKS_X"):  # the MXFP4 kernel with its picks on the grid's fast axis
            grid = grid[::-1]
        out = self.dir / "out"
        subprocess.run([str(binary), *names, *map(str, grid), str(threads), str(out_rows * N), str(out)], check=True)
        if dtype == mx.bfloat16:
            return _f32(mx.array(np.fromfile(out, np.uint16).reshape(out_rows, N)).view(mx.bfloat16))
        return np.fromfile(out, np.float32).reshape(out_rows, N)


MAIN_GDN = SLURP + r"""
int main(int argc, char** argv) {
    std::vector<std::vector<char>> in;
    for (int i = 0; i < NUM_INPUTS; ++i) in.push_back(slurp(argv[1 + i]));
    const int gx = atoi(argv[1 + NUM_INPUTS]), tx = atoi(argv[2 + NUM_INPUTS]);
    std::vector<std::vector<float>> outs(NUM_OUTPUTS);
    for (int o = 0; o < NUM_OUTPUTS; ++o) outs[o].assign(atol(argv[3 + NUM_INPUTS + 2 * o]), NAN);
    blockDim.x = tx;
    std::barrier<> bar(32); warp_barrier = &bar;
    std::vector<std::thread> lanes;  // made once: they run the warps in turn, meeting after each
    for (int l = 0; l < 32; ++l) lanes.emplace_back([&, l] {
        for (int bx = 0; bx < gx; ++bx) for (int wp = 0; wp < tx / 32; ++wp) {
            threadIdx.x = wp * 32 + l; blockIdx.x = bx; CALL;
            bar.arrive_and_wait();
        }
    });
    for (auto& t : lanes) t.join();
    for (int o = 0; o < NUM_OUTPUTS; ++o) {
        FILE* f = fopen(argv[4 + NUM_INPUTS + 2 * o], "wb"); fwrite(outs[o].data(), 4, outs[o].size(), f); fclose(f);
    }
}
"""
# name: (inputs, outputs, body); every array float32 but dims
GDN_KINDS = {
    "scan": (["dims", "q", "k", "v", "g", "beta", "S"], ["y", "S_out"], gdn_window.SCAN),
    "prepare": (gdn_window.PREPARE_INPUTS, gdn_window.PREPARE_OUTPUTS, gdn_window.PREPARE),
}


class GDNEmulator:
    """The GDN window kernels on the CPU (float32): `scan` and `prepare` with gdn_window's launch shapes."""

    name, header = "gdn", gdn_window.HEADER

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}

    def kinds(self) -> dict:
        return GDN_KINDS

    def consts(self, kind: str, const) -> str:
        """The template values MLX would define, for float32 inputs; `const` the compiled size
        (prepare: PER and the conv's taps)."""
        if kind == "scan":
            return f"constexpr int DK = {const};"
        per, taps = const
        return (f"using TX = float; using TW = float; using TA = float; using TB = float; using TL = float; "
                f"using TD = float; constexpr int PER = {per}; constexpr int KS = {taps};")

    def _binary(self, kind: str, const: int) -> Path:
        key = (kind, const)
        if key not in self.built:
            inputs, outputs, body = self.kinds()[kind]
            params = ["const int32_t* dims"] + [f"const float* {n}" for n in inputs[1:]] + [f"float* {n}" for n in outputs]
            args = [f"({p.rsplit(' ', 1)[0]})in[{i}].data()" for i, p in enumerate(params[: len(inputs)])]
            args += [f"outs[{o}].data()" for o in range(len(outputs))]
            source = (program(SHIM, self.backend, self.header, params, self.consts(kind, const), body)
                      + MAIN_GDN.replace("NUM_INPUTS", str(len(inputs))).replace("NUM_OUTPUTS", str(len(outputs)))
                      .replace("CALL", f"kernel({', '.join(args)})"))
            path = self.dir / f"{self.name}_{kind}_{'_'.join(map(str, np.atleast_1d(const)))}"
            compile_program(path, source)
            self.built[key] = path
        return self.built[key]

    def _run(self, kind: str, const: int, inputs: list, config: dict, shapes: list) -> list[np.ndarray]:
        binary = self._binary(kind, const)
        names = write_inputs(self.dir, "gin", inputs)
        threads = config["threadgroup"][0]
        outs = [self.dir / f"gout{o}" for o in range(len(shapes))]
        sizes = [str(int(np.prod(shape))) for shape in shapes]
        subprocess.run([str(binary), *names, str(config["grid"][0] // threads), str(threads),
                        *[x for pair in zip(sizes, map(str, outs)) for x in pair]], check=True)
        return [np.fromfile(out, np.float32).reshape(shape) for out, shape in zip(outs, shapes)]

    def scan(self, q, k, v, g, beta, S) -> list[np.ndarray]:
        """gdn_window.gdn_scan's launch, emulated: numpy float32 in, [y, S_final] out."""
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2:]
        return self._run("scan", Dk, [np.array([B, T, Hk, Hv, Dv], np.int32), q, k, v, g, beta, S],
                         gdn_window.scan_launch(B, Hv, Dv), [(B, T, Hv, Dv), (B, Hv, Dk, Dv)])

    def prepare(self, history, raw, conv_weight, a, b, A_log, dt_bias, *, num_k_heads: int, head_k_dim: int):
        """gdn_window.gdn_prepare's launch, emulated: [q, k, v, g, beta, window]."""
        B, T, C = raw.shape
        K = conv_weight.shape[1]
        Hv = a.shape[2]
        Hk, Dk = num_k_heads, head_k_dim
        Dv = (C - 2 * Hk * Dk) // Hv
        return self._run("prepare", (max(Dk, Dv) // 32, K),
                         [np.array([B, T, Hk, Hv, Dk, Dv, K], np.int32), history, raw, conv_weight, a, b, A_log,
                          dt_bias], gdn_window.prepare_launch(B, T, Hk, Hv),
                         [(B, T, Hk, Dk), (B, T, Hk, Dk), (B, T, Hv, Dv), (B, T, Hv), (B, T, Hv), (B, K - 1 + T, C)])


# name: (inputs, outputs, body); every array float32 but dims
MAMBA2_KINDS = {
    "scan": (["dims", "x", "Bm", "Cm", "dt", "g", "S"], ["y", "S_out"], mamba2_window.SCAN),
    "prepare": (mamba2_window.PREPARE_INPUTS, mamba2_window.PREPARE_OUTPUTS, mamba2_window.PREPARE),
}


class Mamba2Emulator(GDNEmulator):
    """The Mamba-2 window kernels on the CPU (float32), with mamba2_window's launch shapes."""

    name, header = "mamba2", ""

    def kinds(self) -> dict:
        return MAMBA2_KINDS

    def consts(self, kind: str, const: int) -> str:
        """`const`: the scan's state size, or the prepare conv's taps."""
        types = " ".join(f"using T{i} = float;" for i in range(6))  # the input dtypes, template values
        return f"constexpr int NS = {const}; {types}" if kind == "scan" else f"{types} constexpr int KS = {const};"

    def scan(self, x, Bm, Cm, dt, g, S) -> list[np.ndarray]:
        """mamba2_window.mamba2_scan's launch, emulated: numpy float32 in, [y, S_final] out."""
        B, T, H, P = x.shape
        G, N = Bm.shape[2:]
        return self._run("scan", N, [np.array([B, T, H, G, P], np.int32), x, Bm, Cm, dt, g, S],
                         mamba2_window.scan_launch(B, H, P), [(B, T, H, P), (B, H, P, N)])

    def prepare(self, history, raw, conv_weight, conv_bias, dt, dt_bias, A_log, *, num_heads: int, head_dim: int,
                n_groups: int, state_size: int, dt_limits: tuple[float, float]):
        """mamba2_window.mamba2_prepare's launch, emulated: [x, B, C, dt, g, window]."""
        B, T, C = raw.shape
        K = conv_weight.shape[1]
        H, P, G, N = num_heads, head_dim, n_groups, state_size
        if conv_bias is None:
            conv_bias = np.zeros(C, np.float32)
        return self._run("prepare", K, [np.array([B, T, H, P, G, N, K], np.int32), history, raw, conv_weight,
                                        conv_bias, dt, dt_bias, A_log, np.array(dt_limits, np.float32)],
                         mamba2_window.prepare_launch(B, T, C, H),
                         [(B, T, H, P), (B, T, G, N), (B, T, G, N), (B, T, H), (B, T, H), (B, K - 1 + T, C)])


def check_mamba2(emu: Mamba2Emulator, B: int, H: int, P: int, G: int, N: int, *, rows=range(1, 9), tol=1e-5,
                 bias: bool = True, dt_limits=(0.001, float("inf"))) -> bool:
    """For each T in `rows`: the T-row call equals T chained (prepare: separate) 1-row calls bit for
    bit, and stays within `tol` (relative to the largest value) of the reference (mamba2_window's
    `reference_*`, the layer's MLX ops)."""
    T_max = max(rows)
    window, w, conv_bias, dt, dt_bias, A_log = mamba2_window.probe_inputs(B, T_max, H, P, G, N)
    conv_bias = conv_bias if bias else None
    shapes = {"num_heads": H, "head_dim": P, "n_groups": G, "state_size": N, "dt_limits": dt_limits}
    K = w.shape[1]
    np_bias = None if conv_bias is None else _f32(conv_bias)
    np_in = [_f32(x) for x in (window, w, dt, dt_bias, A_log)]
    alone = [emu.prepare(np_in[0][:, t : t + K - 1], np_in[0][:, t + K - 1 : t + K], np_in[1], np_bias,
                         np_in[2][:, t : t + 1], *np_in[3:], **shapes)[:5] for t in range(T_max)]
    alone = [np.concatenate(parts, axis=1) for parts in zip(*alone)]
    ok = True
    where = f"H={H} P={P} G={G} N={N}" + ("" if bias else " no bias")
    for T in rows:
        *got, joined = emu.prepare(np_in[0][:, : K - 1], np_in[0][:, K - 1 : K - 1 + T], np_in[1], np_bias,
                                   np_in[2][:, :T], *np_in[3:], **shapes)
        expected = mamba2_window.reference_prepare(window[:, : K - 1 + T], w, conv_bias, dt[:, :T], dt_bias, A_log,
                                                   **shapes)
        same = (all(np.array_equal(x, y[:, :T]) for x, y in zip(got, alone))
                and np.array_equal(joined, np_in[0][:, : K - 1 + T]))  # the window joined, every cell written
        diff = max(_relative(x, _f32(y)) for x, y in zip(got, expected))
        ok &= _report(f"mamba2_prepare {where}", T, same, diff, tol)

    x, Bm, Cm, dt_, g = (_f32(a) for a in mamba2_window.reference_prepare(window, w, conv_bias, dt, dt_bias, A_log,
                                                                           **shapes))
    S0 = _f32(mx.random.normal((B, H, P, N), key=mx.random.key(1)) * 0.1)
    chained_y, chained_S, S = [], [], S0
    for t in range(T_max):
        y_t, S = emu.scan(*(a[:, t : t + 1] for a in (x, Bm, Cm, dt_, g)), S)
        chained_y.append(y_t)
        chained_S.append(S)
    chained_y = np.concatenate(chained_y, axis=1)
    for T in rows:
        y, S_T = emu.scan(*(a[:, :T] for a in (x, Bm, Cm, dt_, g)), S0)
        same = np.array_equal(y, chained_y[:, :T]) and np.array_equal(S_T, chained_S[T - 1])
        y_ref, S_ref = mamba2_window.reference_scan(*(mx.array(a[:, :T]) for a in (x, Bm, Cm, dt_, g)), mx.array(S0))
        diff = max(_relative(y, _f32(y_ref)), _relative(S_T, _f32(S_ref)))
        ok &= _report(f"mamba2_scan {where}", T, same, diff, tol)
    return ok


def gdn_inputs(B: int, Hk: int, Hv: int, Dk: int, Dv: int, *, rows: int = 8, conv_kernel: int = 4, seed: int = 0):
    """Random float32 prepare inputs (window, conv weight, a, b, A_log, dt_bias) for `rows` rows."""
    C = 2 * Hk * Dk + Hv * Dv
    keys = mx.random.split(mx.random.key(seed), 6)
    return (mx.random.normal((B, conv_kernel - 1 + rows, C), key=keys[0]),
            mx.random.normal((C, conv_kernel), key=keys[1]) * 0.5,
            mx.random.normal((B, rows, Hv), key=keys[2]), mx.random.normal((B, rows, Hv), key=keys[3]),
            mx.random.uniform(-1, 1, (Hv,), key=keys[4]), mx.random.uniform(0, 1, (Hv,), key=keys[5]))


def _relative(got, expected) -> float:
    return float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-30))


def check_gdn(emu: GDNEmulator, B: int, Hk: int, Hv: int, Dk: int, Dv: int, *, rows=range(1, 9), tol=1e-5) -> bool:
    """For each T in `rows`: the T-row call equals T chained (prepare: separate) 1-row calls bit for
    bit, and stays within `tol` (relative to the largest value) of the reference."""
    T_max = max(rows)
    window, w, a, b, A_log, dt_bias = gdn_inputs(B, Hk, Hv, Dk, Dv, rows=T_max)
    heads = {"num_k_heads": Hk, "head_k_dim": Dk}
    K = w.shape[1]
    np_in = [_f32(x) for x in (window, w, a, b, A_log, dt_bias)]
    alone = [emu.prepare(np_in[0][:, t : t + K - 1], np_in[0][:, t + K - 1 : t + K], np_in[1], np_in[2][:, t : t + 1],
                         np_in[3][:, t : t + 1], *np_in[4:], **heads)[:5] for t in range(T_max)]
    alone = [np.concatenate(parts, axis=1) for parts in zip(*alone)]
    ok = True
    for T in rows:
        *got, joined = emu.prepare(np_in[0][:, : K - 1], np_in[0][:, K - 1 : K - 1 + T], np_in[1], np_in[2][:, :T],
                                   np_in[3][:, :T], *np_in[4:], **heads)
        expected = gdn_window.reference_prepare(window[:, : K - 1 + T], w, a[:, :T], b[:, :T], A_log, dt_bias, **heads)
        same = (all(np.array_equal(x, y[:, :T]) for x, y in zip(got, alone))
                and np.array_equal(joined, np_in[0][:, : K - 1 + T]))  # the window joined, every cell written
        diff = max(_relative(x, _f32(y)) for x, y in zip(got, expected))
        ok &= _report(f"gdn_prepare Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}", T, same, diff, tol)

    q, k, v, g, beta = (_f32(x) for x in gdn_window.reference_prepare(window, w, a, b, A_log, dt_bias, **heads))
    S0 = _f32(mx.random.normal((B, Hv, Dk, Dv), key=mx.random.key(1)) * 0.1)
    chained_y, chained_S, S = [], [], S0
    for t in range(T_max):
        y_t, S = emu.scan(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], S)
        chained_y.append(y_t)
        chained_S.append(S)
    chained_y = np.concatenate(chained_y, axis=1)
    for T in rows:
        y, S_T = emu.scan(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], S0)
        same = np.array_equal(y, chained_y[:, :T]) and np.array_equal(S_T, chained_S[T - 1])
        y_ref, S_ref = gdn_window.reference_scan(*(mx.array(x[:, :T]) for x in (q, k, v, g, beta)), mx.array(S0))
        diff = max(_relative(y, _f32(y_ref)), _relative(S_T, _f32(S_ref)))
        ok &= _report(f"gdn_scan Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}", T, same, diff, tol)
    return ok


# A whole block at once, for bodies whose warps cooperate through shared memory: every thread of
# the block runs concurrently; `__shared__` is a static (blocks run one after another),
# `__syncthreads` a block barrier, shuffles and `__syncwarp` go through their warp's barrier.
SHIM_BLOCK = SHIM_BASE + r"""
#include <memory>
using std::min;
#define __shared__ static
constexpr int MAX_WARPS = 32;
std::barrier<>* warp_barriers[MAX_WARPS];
std::barrier<>* block_barrier;
float warp_slots[MAX_WARPS][32];
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    warp_barriers[w]->arrive_and_wait();
    warp_slots[w][lane] = v;
    warp_barriers[w]->arrive_and_wait();
    return warp_slots[w][lane ^ off];
}
inline void __syncwarp() { warp_barriers[threadIdx.x >> 5]->arrive_and_wait(); }
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
"""
MAIN_BLOCK = SLURP + r"""
int main(int argc, char** argv) {
    std::vector<std::vector<char>> in;
    for (int i = 0; i < NUM_INPUTS; ++i) in.push_back(slurp(argv[1 + i]));
    const int gx = atoi(argv[1 + NUM_INPUTS]), tx = atoi(argv[2 + NUM_INPUTS]);
    // NUM_OUTPUTS outputs of 4-byte words (size, then path, each), NaN until written
    std::vector<std::vector<float>> outs(NUM_OUTPUTS);
    for (int o = 0; o < NUM_OUTPUTS; ++o) outs[o].assign(atol(argv[3 + NUM_INPUTS + 2 * o]), NAN);
    std::vector<float>& out = outs[0];
    blockDim.x = tx;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (int w = 0; w < tx / 32; ++w) warps.emplace_back(new std::barrier<>(32)), warp_barriers[w] = warps.back().get();
    std::barrier<> block(tx); block_barrier = &block;
    std::vector<std::thread> threads;  // made once: they run the blocks in turn, meeting after each
    for (int i = 0; i < tx; ++i) threads.emplace_back([&, i] {
        for (int bx = 0; bx < gx; ++bx) { threadIdx.x = i; blockIdx.x = bx; CALL; block.arrive_and_wait(); }
    });
    for (auto& t : threads) t.join();
    for (int o = 0; o < NUM_OUTPUTS; ++o) {
        FILE* f = fopen(argv[4 + NUM_INPUTS + 2 * o], "wb"); fwrite(outs[o].data(), 4, outs[o].size(), f); fclose(f);
    }
}
"""
def block_program(shim: str, backend: str, header: str, params: list[str], outputs: list[tuple[str, str]],
                  consts: str, body: str) -> str:
    """A block-at-a-time kernel's whole program (MAIN_BLOCK): `params` its inputs (each read
    from a file), `outputs` its (element type, name) pairs (written as 4-byte words)."""
    args = [f"({p.rsplit(' ', 1)[0]})in[{i}].data()" for i, p in enumerate(params)]
    args += [f"({t}*)outs[{i}].data()" for i, (t, _) in enumerate(outputs)]
    return (program(shim, backend, header, [*params, *(f"{t}* {name}" for t, name in outputs)], consts, body)
            + MAIN_BLOCK.replace("NUM_INPUTS", str(len(params))).replace("NUM_OUTPUTS", str(len(outputs)))
            .replace("CALL", f"kernel({', '.join(args)})"))


# (parameter, file) pairs as MLX passes them with ensure_row_contiguous=False: an input, then its strides
ATTENTION_PARAMS = ["const int32_t* dims", "const float* scale", "const float* q", "const int64_t* q_strides",
                    "const float* keys", "const int64_t* keys_strides", "const float* values",
                    "const int64_t* values_strides"]


class AttentionEmulator:
    """attention_window's kernel on the CPU (float32), a block at a time, through strides as MLX
    passes views; a view longer than attention_window.SPLIT_CELLS through the split kernel and
    its combine, as `attention_window` calls them."""

    params = ATTENTION_PARAMS
    combine_params = ["const int32_t* dims", "const float* parts"]

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}
        self.source = attention_window.SOURCE

    def split_sources(self) -> tuple[str, str]:
        """The split kernel's and the combine's bodies (read at each build, so a test may swap one)."""
        return attention_window.SPLIT_SOURCE, attention_window.COMBINE_SOURCE

    def _binary(self, D: int, kind: str = "window") -> Path:
        """The program of one kernel: "window" (self.source), "split" or "combine" (whose header
        holds SPLIT_CELLS as it is now)."""
        key = (D, kind, attention_window.SPLIT_CELLS if kind != "window" else 0)
        if key not in self.built:
            consts = f"using TQ = float; using TK = float; using TV = float; constexpr int DH = {D};"
            if kind == "window":
                params, source, header = self.params, self.source, attention_window.header()
            else:
                split, combine = self.split_sources()
                params, source = (self.params, split) if kind == "split" else (self.combine_params, combine)
                header = attention_window.split_header()
            text = block_program(SHIM_BLOCK, self.backend, header, params, [("float", "out")], consts, source)
            path = self.dir / f"attention_{kind}_{D}_{len(self.built)}"
            compile_program(path, text)
            self.built[key] = path
        return self.built[key]

    def run(self, q_rows: np.ndarray, keys: np.ndarray, values: np.ndarray, L: int, scale: float) -> np.ndarray:
        """q_rows (B, T, Hq, D), read as the (B, Hq, T, D) view the layer passes; keys, values
        (B, Hkv, capacity, D) buffers of which the kernel sees cells 0..L-1. Returns (B, T, Hq, D)."""
        return self._launch(q_rows, keys, values, [q_rows.shape[0], q_rows.shape[2], keys.shape[1], q_rows.shape[1], L],
                            scale, [])

    def _launch(self, q_rows, keys, values, shape: list[int], scale: float, more: list[np.ndarray]) -> np.ndarray:
        B, T, Hq, D = q_rows.shape
        q_rows, keys, values = (np.ascontiguousarray(a, np.float32) for a in (q_rows, keys, values))

        def strides(a, order=(0, 1, 2, 3)):
            return np.array([a.strides[i] // a.itemsize for i in order], np.int64)

        inputs = [np.array(shape, np.int32), np.array([scale], np.float32), q_rows,
                  strides(q_rows, (0, 2, 1, 3)), keys, strides(keys), values, strides(values), *more]
        names = write_inputs(self.dir, "ain", inputs)
        out = self.dir / "aout"
        S = attention_window.splits(shape[4])
        if S == 1:
            self._run(self._binary(D), names, attention_window.launch(B, Hq, T), B * T * Hq * D, out)
            return np.fromfile(out, np.float32).reshape(B, T, Hq, D)
        parts = self.dir / "aparts"
        self._run(self._binary(D, "split"), names, attention_window.launch(B, Hq, T, S), B * Hq * T * S * (D + 2), parts)
        self._run(self._binary(D, "combine"), [names[0], str(parts), *names[len(ATTENTION_PARAMS):]],
                  attention_window.combine_launch(B, Hq, T, D), B * T * Hq * D, out)
        return np.fromfile(out, np.float32).reshape(B, T, Hq, D)

    @staticmethod
    def _run(binary: Path, names: list[str], config: dict, size: int, out: Path) -> None:
        threads = config["threadgroup"][0]
        subprocess.run([str(binary), *names, str(config["grid"][0] // threads), str(threads), str(size), str(out)],
                       check=True)


class SinkAttentionEmulator(AttentionEmulator):
    """attention_window's sink kernel (`SINK_SOURCE`: sinks, and a ring window) on the CPU."""

    params = [*ATTENTION_PARAMS, "const float* sinks"]
    combine_params = [*AttentionEmulator.combine_params, "const float* sinks"]

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        super().__init__(workdir, backend)
        self.source = attention_window.SINK_SOURCE

    def split_sources(self) -> tuple[str, str]:
        return attention_window.SINK_SPLIT_SOURCE, attention_window.SINK_COMBINE_SOURCE

    def run_sinks(self, q_rows, keys, values, L: int, scale: float, sinks: np.ndarray, pos0: int, window: int):
        """As `run`, with (Hq,) sinks; with `window` the view is a ring of L cells and the first
        row sits at position pos0. Returns (B, T, Hq, D)."""
        shape = [q_rows.shape[0], q_rows.shape[2], keys.shape[1], q_rows.shape[1], L,
                 attention_window.ring_position(pos0, L, window), window]
        return self._launch(q_rows, keys, values, shape, scale, [np.ascontiguousarray(sinks, np.float32)])


def check_sink_attention(emu: SinkAttentionEmulator, B: int, Hq: int, Hkv: int, D: int, cells: int, window: int, *,
                         pos0: int, rows=range(1, 9), tol=1e-5, seed: int = 0, sink_offset: float = 0.0) -> bool:
    """With `window`, a ring of `cells` cells whose first row sits at `pos0` (all rows see the
    whole ring buffer, masked by position); without, row t sees `cells` + t cells. For each T
    in `rows`: the T-row call equals each row's 1-row call bit for bit (serial decoding's step)
    and stays within `tol` of `reference_sink_attention_window`. `sink_offset` is added to the
    sinks (N(0, 4) otherwise): a large one makes the sink the softmax's largest logit."""
    T_max = max(rows)
    keys_ = mx.random.split(mx.random.key(seed), 4)
    L_full = cells if window else cells - 1 + T_max
    q = mx.random.normal((B, T_max, Hq, D), key=keys_[0])
    k, v = (mx.random.normal((B, Hkv, L_full + 5, D), key=key) for key in keys_[1:3])
    sinks = mx.random.normal((Hq,), key=keys_[3]) * 2 + sink_offset
    q_np, k_np, v_np, s_np = _f32(q), _f32(k), _f32(v), _f32(sinks)
    scale = D**-0.5

    def call(t0: int, T: int) -> np.ndarray:
        L = cells if window else cells - 1 + t0 + T
        return emu.run_sinks(q_np[:, t0 : t0 + T], k_np, v_np, L, scale, s_np, pos0 + t0, window)

    alone = np.concatenate([call(t, 1) for t in range(T_max)], axis=1)
    ok = True
    for T in rows:
        got = call(0, T)
        L = cells if window else cells - 1 + T
        mask = attention_window.ring_mask(pos0, T, L, window) if window else None
        expected = attention_window.reference_sink_attention_window(q[:, :T].transpose(0, 2, 1, 3), k[:, :, :L],
                                                                    v[:, :, :L], scale, sinks, mask=mask)
        same = np.array_equal(got, alone[:, :T])
        ok &= _report(f"sinks B={B} Hq={Hq} D={D} L={cells} W={window}", T, same, _relative(got, _f32(expected)), tol)
    return ok


def check_attention(emu: AttentionEmulator, B: int, Hq: int, Hkv: int, D: int, cells: int, *, rows=range(1, 9),
                    tol=1e-5, seed: int = 0) -> bool:
    """Row t of a window sees `cells` + t cells (row 0 sees `cells`). For each T in `rows`: the
    T-row call equals each row's 1-row call bit for bit (serial decoding's step over the same
    cache buffer) and stays within `tol` (relative to the largest value) of the reference."""
    T_max, P = max(rows), cells - 1
    keys_ = mx.random.split(mx.random.key(seed), 3)
    capacity = P + T_max + 5  # the kernel reads a view of a longer buffer, as the KV cache passes it
    q = mx.random.normal((B, T_max, Hq, D), key=keys_[0])
    k, v = (mx.random.normal((B, Hkv, capacity, D), key=key) for key in keys_[1:])
    q_np, k_np, v_np = _f32(q), _f32(k), _f32(v)
    scale = D**-0.5
    alone = np.concatenate([emu.run(q_np[:, t : t + 1], k_np, v_np, P + t + 1, scale) for t in range(T_max)], axis=1)
    ok = True
    for T in rows:
        got = emu.run(q_np[:, :T], k_np, v_np, P + T, scale)
        expected = attention_window.reference_attention_window(q[:, :T].transpose(0, 2, 1, 3), k[:, :, : P + T],
                                                               v[:, :, : P + T], scale)
        same = np.array_equal(got, alone[:, :T])
        ok &= _report(f"attention B={B} Hq={Hq} Hkv={Hkv} D={D} L={cells}", T, same, _relative(got, _f32(expected)), tol)
    return ok


ROUTER_PARAMS = ["const int32_t* dims", "const float* logits"]


class RouterEmulator:
    """router_window's kernel on the CPU (float32 logits), a block (row) at a time, its two
    outputs (inds, weights) as MLX declares them, the logits rows of W values, the router's E first."""

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[int, Path] = {}
        self.source = router_window.SOURCE

    def _binary(self, per: int) -> Path:
        if per not in self.built:
            consts = f"using T_IN = float; constexpr int PER = {per};"
            source = block_program(SHIM_BLOCK, self.backend, router_window.HEADER, ROUTER_PARAMS,
                                   [("uint32_t", "inds"), ("float", "weights")], consts, self.source)
            path = self.dir / f"router_{per}_{len(self.built)}"
            compile_program(path, source)
            self.built[per] = path
        return self.built[per]

    def run(self, buffer: np.ndarray, E: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The kernel over the rows of `buffer` (R, W >= E), reading each row's first E values, as
        the stacked router's output is passed. Returns inds (R, k) uint32, weights (R, k)."""
        buffer = np.ascontiguousarray(buffer, np.float32)
        R, W = buffer.shape
        inputs = [np.array([R, E, k, W], np.int32), buffer]
        names = write_inputs(self.dir, "rin", inputs)
        config = router_window.launch(R)
        threads = config["threadgroup"][0]
        outs = [self.dir / "rout0", self.dir / "rout1"]
        subprocess.run([str(self._binary(router_window.per_thread(E))), *names,
                        str(config["grid"][0] // threads), str(threads), str(R * k), str(outs[0]), str(R * k),
                        str(outs[1])], check=True)
        return np.fromfile(outs[0], np.uint32).reshape(R, k), np.fromfile(outs[1], np.float32).reshape(R, k)


def check_router(emu: RouterEmulator, E: int, k: int, *, rows=range(1, 9), dtype=mx.float32, tol=1e-6,
                 seed: int = 0) -> bool:
    """For each R in `rows`: every row of an R-row call (as a plain (R, E) array and as the first
    E columns of rows E + 3 wide) equals its 1-row call bit for bit; the picks equal the reference's
    (descending, ties to the lower index; the probe's rows include exact ties) and every weight is
    within `tol` (relative) of the float32 reference. `dtype`: the logits' values (bfloat16 ones
    tie often) given to the kernel as float32."""
    R_max = max(rows)
    logits = router_window.probe_logits(E, rows=R_max, dtype=dtype, seed=seed).astype(mx.float32)
    plain = _f32(logits)
    padded = np.concatenate([plain, np.full((R_max, 3), 7.0, np.float32)], axis=1)  # rows E + 3 apart
    alone = [emu.run(plain[t : t + 1], E, k) for t in range(R_max)]
    alone = [np.concatenate(parts) for parts in zip(*alone)]
    ok = True
    for R in rows:
        inds, weights = emu.run(plain[:R], E, k)
        viewed = emu.run(padded[:R], E, k)
        ref_inds, ref_weights = (np.array(a) for a in router_window.reference_router_window(logits[:R], k))
        same = (np.array_equal(inds, alone[0][:R]) and np.array_equal(weights, alone[1][:R])
                and np.array_equal(viewed[0], inds) and np.array_equal(viewed[1], weights))
        picks_match = np.array_equal(inds, ref_inds)
        diff = float(np.max(np.abs(weights - ref_weights) / np.abs(ref_weights))) if picks_match else float("inf")
        ok &= _report(f"router E={E} k={k} {str(dtype).split('.')[-1]}", R, same, diff, tol)
    return ok


# bfloat16 in software for the add-norm and combine kernels, whose rounding to the dtype is the point: a float
# rounds to nearest even (a NaN stays a quiet NaN), a bfloat16 widens exactly. As __nv_bfloat16
# and Metal's bfloat16_t convert.
BF16_SHIM = r"""
struct strata_bf16 {
    uint16_t bits;
    strata_bf16() = default;
    explicit strata_bf16(float f) {
        uint32_t u; std::memcpy(&u, &f, 4);
        bits = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                               : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    explicit operator float() const { const uint32_t u = static_cast<uint32_t>(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
// bfloat16 arithmetic (embed_rows' dequantize, written in T as MLX writes it): each operation in
// float, rounded, as MLX's CPU ops (the reference here) compute a product and a sum.
inline strata_bf16 operator*(strata_bf16 a, strata_bf16 b) { return strata_bf16(float(a) * float(b)); }
inline strata_bf16 operator+(strata_bf16 a, strata_bf16 b) { return strata_bf16(float(a) + float(b)); }
"""
EMULATED_TYPES = {mx.float32: ("float", np.uint32), mx.bfloat16: ("strata_bf16", np.uint16)}


def raw_bits(a: mx.array) -> np.ndarray:
    """a's bits as unsigned integers of its width (float32 or bfloat16)."""
    return np.array(a.view(mx.uint32 if a.dtype == mx.float32 else mx.uint16))


class AddNormEmulator:
    """add_norm's kernel on the CPU, a block (row) at a time, in float32 or in bfloat16 (in
    software, BF16_SHIM), its two outputs (h, normed) as MLX declares them."""

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}
        self.source = add_norm.SOURCE

    def _binary(self, per: int, dtype) -> Path:
        if (per, dtype) not in self.built:
            t = EMULATED_TYPES[dtype][0]
            params = ["const int32_t* dims", "const float* eps", f"const {t}* x", f"const {t}* y", f"const {t}* weight"]
            source = block_program(SHIM_BLOCK + BF16_SHIM, self.backend, add_norm.HEADER, params,
                                   [(t, "h"), (t, "normed")], f"using T = {t}; constexpr int PER = {per};", self.source)
            path = self.dir / f"add_norm_{per}_{t}_{len(self.built)}"
            compile_program(path, source)
            self.built[per, dtype] = path
        return self.built[per, dtype]

    def run(self, x: mx.array, y: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        """The kernel over the rows of x, y (R, H) (one dtype, float32 or bfloat16) with `weight`
        (H,): h and normed (R, H) in that dtype, their bits as the kernel wrote them."""
        R, H = x.shape
        bits = EMULATED_TYPES[x.dtype][1]
        inputs = [np.array([R, H], np.int32), np.array([eps], np.float32), raw_bits(x), raw_bits(y), raw_bits(weight)]
        names = write_inputs(self.dir, "nin", inputs)
        config = add_norm.launch(R)
        threads = config["threadgroup"][0]
        words = -(-R * H * np.dtype(bits).itemsize // 4)  # the emulator's outputs are 4-byte words
        outs = [self.dir / "nout0", self.dir / "nout1"]
        subprocess.run([str(self._binary(add_norm.per_thread(H), x.dtype)), *names,
                        str(config["grid"][0] // threads), str(threads), str(words), str(outs[0]), str(words),
                        str(outs[1])], check=True)
        return tuple(mx.array(np.fromfile(out, bits)[: R * H].reshape(R, H)).view(x.dtype) for out in outs)


def check_add_norm(emu: AddNormEmulator, H: int, *, rows=range(1, 9), dtype=mx.float32, seed: int = 0,
                   eps: float = 1e-6) -> bool:
    """For each R in `rows`: every row of an R-row call equals its 1-row call bit for bit (h and
    normed), h equals MLX's x + y bit for bit, and normed is within add_norm.TOLERANCE of the
    reference (mx.fast.rms_norm's CPU form); also printed: how many normed values equal
    mx.fast.rms_norm's bits."""
    x, y, weight = add_norm.probe_inputs(H, rows=max(rows), dtype=dtype, seed=seed)
    alone = [emu.run(x[t : t + 1], y[t : t + 1], weight, eps) for t in range(max(rows))]
    alone = [np.concatenate([raw_bits(a[i]) for a in alone]) for i in range(2)]
    ok = True
    for R in rows:
        h, normed = emu.run(x[:R], y[:R], weight, eps)
        ref_h, ref = add_norm.reference_add_norm(x[:R], y[:R], weight, eps)
        same = np.array_equal(raw_bits(h), alone[0][:R]) and np.array_equal(raw_bits(normed), alone[1][:R])
        exact_h = np.array_equal(raw_bits(h), raw_bits(x[:R] + y[:R]))
        got, expected = _f32(normed), _f32(ref)
        err = np.abs(got - expected)
        diff = float(np.max(np.where(expected == 0, err, err / np.maximum(np.abs(expected), 1e-30))))
        fast = raw_bits(mx.fast.rms_norm(x[:R] + y[:R], weight, eps))
        name = f"add_norm H={H} {str(dtype).split('.')[-1]}"
        ok &= _report(name, R, same and exact_h, diff if exact_h else float("inf"), add_norm.TOLERANCE[dtype])
        print(f"{'':34s} h == MLX's x + y: {exact_h}  normed bits == mx.fast.rms_norm's (CPU): "
              f"{int(np.sum(raw_bits(normed) == fast))} of {fast.size}", flush=True)
    return ok


# A thread at a time, block after block (x within y): for bodies whose threads never meet (no
# barrier, no shuffle). NUM_INPUTS inputs, then the grid's blocks (x, y), the block's threads,
# the output's element count and path; the output is OUT_T, unwritten elements all-ones (NaN).
class GatedNormEmulator:
    """gated_norm's kernel on the CPU, a block (a row's group) at a time, the gate, weight and
    output in float32 or in bfloat16 (in software, BF16_SHIM), y in float32."""

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}
        self.source = gated_norm.SOURCE

    def _binary(self, group_size: int, dtype, gate_first: bool) -> Path:
        key = (group_size, dtype, gate_first)
        if key not in self.built:
            t = EMULATED_TYPES[dtype][0]
            params = ["const int32_t* dims", "const float* eps", "const float* y", f"const {t}* z", f"const {t}* weight"]
            consts = (f"using T = {t}; constexpr int PER = {gated_norm.per_thread(group_size)}; "
                      f"constexpr int WARPS = {gated_norm.warps(group_size)}; "
                      f"constexpr bool GATE_FIRST = {str(gate_first).lower()};")
            source = block_program(SHIM_BLOCK + BF16_SHIM, self.backend, "", params, [(t, "out")], consts, self.source)
            path = self.dir / f"gated_norm_{group_size}_{t}_{int(gate_first)}_{len(self.built)}"
            compile_program(path, source)
            self.built[key] = path
        return self.built[key]

    def run(self, y: mx.array, z: mx.array, weight: mx.array, eps: float, *, groups: int, group_size: int,
            gate_first: bool = False) -> mx.array:
        """gated_norm's call, emulated: y float32 of z's size, z (..., C) float32 or bfloat16, the
        weight (group_size,) or (C,) in z's dtype. Returns z's shape and dtype, the kernel's bits."""
        R = z.size // (groups * group_size)
        step = 0 if weight.size == group_size else group_size
        bits = EMULATED_TYPES[z.dtype][1]
        inputs = [np.array([R, groups, group_size, step], np.int32), np.array([eps], np.float32),
                  raw_bits(y.astype(mx.float32)), raw_bits(z), raw_bits(weight)]
        names = write_inputs(self.dir, "gin", inputs)
        config = gated_norm.launch(R, groups, group_size)
        threads = config["threadgroup"][0]
        words = -(-z.size * np.dtype(bits).itemsize // 4)  # the emulator's outputs are 4-byte words
        out = self.dir / "gout0"
        subprocess.run([str(self._binary(group_size, z.dtype, gate_first)), *names, str(config["grid"][0] // threads),
                        str(threads), str(words), str(out)], check=True)
        return mx.array(np.fromfile(out, bits)[: z.size].reshape(z.shape)).view(z.dtype)


def check_gated_norm(emu: GatedNormEmulator, groups: int, group_size: int, *, rows=range(1, 9), dtype=mx.float32,
                     gate_first: bool = False, tiled: bool = False, seed: int = 0, eps: float = 1e-6) -> bool:
    """For each R in `rows`: every row of an R-row call equals its 1-row call bit for bit, and
    the output is within gated_norm.TOLERANCE of the reference (the layers' own MLX ops); also
    printed: how many values equal the reference's bits (MLX's ops on the CPU)."""
    y, z, weight = gated_norm.probe_inputs(groups, group_size, rows=max(rows), dtype=dtype, tiled=tiled, seed=seed)
    spec = {"groups": groups, "group_size": group_size, "gate_first": gate_first}
    alone = np.concatenate([raw_bits(emu.run(y[t : t + 1], z[t : t + 1], weight, eps, **spec))
                            for t in range(max(rows))])
    ok = True
    for R in rows:
        out = emu.run(y[:R], z[:R], weight, eps, **spec)
        ref = gated_norm.reference_gated_norm(y[:R], z[:R], weight, eps, **spec)
        same = np.array_equal(raw_bits(out), alone[:R]) and not np.isnan(_f32(out)).any()
        got, expected = _f32(out), _f32(ref)
        err = np.abs(got - expected)
        diff = float(np.max(np.where(expected == 0, err, err / np.maximum(np.abs(expected), 1e-30))))
        name = (f"gated_norm {groups}x{group_size} {str(dtype).split('.')[-1]}"
                f"{' gate first' if gate_first else ''}{' tiled' if tiled else ''}")
        ok &= _report(name, R, same, diff, gated_norm.TOLERANCE[dtype])
        print(f"{'':34s} bits == MLX's ops (CPU): {int(np.sum(raw_bits(out) == raw_bits(ref)))} of {ref.size}",
              flush=True)
    return ok


MAIN_SERIAL = SLURP + r"""
int main(int argc, char** argv) {
    std::vector<std::vector<char>> in;
    for (int i = 0; i < NUM_INPUTS; ++i) in.push_back(slurp(argv[1 + i]));
    const int gx = atoi(argv[1 + NUM_INPUTS]), gy = atoi(argv[2 + NUM_INPUTS]), tx = atoi(argv[3 + NUM_INPUTS]);
    const long n = atol(argv[4 + NUM_INPUTS]);
    std::vector<OUT_T> out(n);
    std::memset(out.data(), 0xFF, n * sizeof(OUT_T));
    blockDim.x = tx;
    for (int by = 0; by < gy; ++by) for (int bx = 0; bx < gx; ++bx) for (int t = 0; t < tx; ++t) {
        threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; CALL;
    }
    FILE* f = fopen(argv[5 + NUM_INPUTS], "wb"); fwrite(out.data(), sizeof(OUT_T), n, f); fclose(f);
}
"""
EMULATED_TOKENS = {mx.int32: "int32_t", mx.uint32: "uint32_t", mx.int64: "int64_t"}


def serial_program(backend: str, params: list[str], t: str, consts: str, body: str) -> str:
    """A kernel of one output `out` (of type `t`) whose threads never meet, behind `backend`'s
    prelude, run a thread at a time by MAIN_SERIAL: inputs in `params` order from files."""
    args = [f"({p.rsplit(' ', 1)[0]})in[{i}].data()" for i, p in enumerate(params)] + ["out.data()"]
    return (program(SHIM_BLOCK + BF16_SHIM, backend, "", [*params, f"{t}* out"], consts, body)
            + MAIN_SERIAL.replace("NUM_INPUTS", str(len(params))).replace("OUT_T", t)
            .replace("CALL", f"kernel({', '.join(args)})"))


class EmbedRowsEmulator:
    """embed_rows' kernel on the CPU, a thread at a time (its threads never meet), the scales,
    biases and output in float32 or in bfloat16 (in software, BF16_SHIM), int32, uint32 or int64
    token ids, with embed_rows' launch."""

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}
        self.source = embed_rows.SOURCE

    def _binary(self, bits: int, group_size: int, dtype, token_dtype) -> Path:
        key = (bits, group_size, dtype, token_dtype)
        if key not in self.built:
            t, ti = EMULATED_TYPES[dtype][0], EMULATED_TOKENS[token_dtype]
            params = ["const int32_t* dims", f"const {ti}* tokens", "const uint32_t* w", f"const {t}* scales",
                      f"const {t}* biases"]
            consts = f"using T = {t}; using TI = {ti}; constexpr int BITS = {bits}; constexpr int GS = {group_size};"
            source = serial_program(self.backend, params, t, consts, self.source)
            path = self.dir / f"embed_rows_{bits}_{group_size}_{t}_{ti}_{len(self.built)}"
            compile_program(path, source)
            self.built[key] = path
        return self.built[key]

    def run(self, tokens: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *, group_size: int,
            bits: int) -> mx.array:
        """embed_rows' call, emulated: tokens of any shape, w (V, W) uint32, scales and biases (V, G)
        float32 or bfloat16. Returns tokens.shape + (D,) in the scales' dtype, the kernel's bits
        (a value the kernel left unwritten is NaN)."""
        V, W = w.shape
        D = W * 32 // bits
        inputs = [np.array([tokens.size, W, scales.shape[-1], V], np.int32).tobytes(), np.array(tokens).tobytes(),
                  np.array(w).tobytes(), raw_bits(scales).tobytes(), raw_bits(biases).tobytes()]
        names = write_inputs(self.dir, "ein", inputs)
        config = embed_rows.launch(tokens.size, W)
        threads = config["threadgroup"][0]
        out = self.dir / "eout"
        subprocess.run([str(self._binary(bits, group_size, scales.dtype, tokens.dtype)), *names,
                        str(config["grid"][0] // threads), "1", str(threads), str(tokens.size * D), str(out)],
                       check=True)
        values = np.fromfile(out, EMULATED_TYPES[scales.dtype][1]).reshape(*tokens.shape, D)
        return mx.array(values).view(scales.dtype)


def check_embed_rows(emu: EmbedRowsEmulator, bits: int, group_size: int, *, rows=range(1, 9), dtype=mx.float32,
                     token_dtype=mx.int32, seed: int = 0) -> bool:
    """For each R in `rows`: every row of an R-token call equals its 1-token call bit for bit and
    the reference (`nn.QuantizedEmbedding`'s MLX ops on the CPU) bit for bit; 8 tokens as a (2, 4)
    batch give the same rows; out-of-range ids (negative, V, the id dtype's extremes) give zero
    rows. The ids in `token_dtype`."""
    tokens, w, scales, biases = embed_rows.probe_inputs(bits, group_size, dtype=dtype, seed=seed)
    tokens = tokens[: max(rows)].astype(token_dtype)
    spec = {"group_size": group_size, "bits": bits}
    alone = mx.concatenate([emu.run(tokens[t : t + 1], w, scales, biases, **spec) for t in range(max(rows))])
    name = f"embed_rows {bits}-bit gs={group_size} {str(dtype).split('.')[-1]} {str(token_dtype).split('.')[-1]}"
    ok = True
    for R in rows:
        out = emu.run(tokens[:R], w, scales, biases, **spec)
        same = mx.array_equal(out, alone[:R]).item()
        exact = mx.array_equal(out, embed_rows.reference_embed_rows(tokens[:R], w, scales, biases, **spec)).item()
        ok &= _report_exact(name, R, same, exact)  # a value left unwritten (NaN) equals nothing
    if max(rows) == 8:
        batch = emu.run(tokens.reshape(2, 4), w, scales, biases, **spec)
        ok &= _report_exact(f"{name} (2, 4)", 8, mx.array_equal(batch.reshape(alone.shape), alone).item(), True)
    info = np.iinfo(np.dtype(str(token_dtype).split(".")[-1]))
    V = w.shape[0]
    bad = [b for b in (-1, V, V + 1, info.max, info.min) if info.min <= b <= info.max and not 0 <= b < V]
    zeros = emu.run(mx.array(bad, dtype=token_dtype), w, scales, biases, **spec)
    ok &= _report_exact(f"{name} out of range", len(bad), True,
                        mx.array_equal(zeros, mx.zeros(zeros.shape, dtype)).item())
    return ok


def _report_exact(name: str, rows: int, same: bool, exact: bool) -> bool:
    """A check of rows against their 1-row calls and of bits against what they must be."""
    print(f"{name:34s} rows {rows:2d}  identical to 1-row calls: {same!s:5s}  expected bits: {exact!s:5s}  "
          f"{'ok' if same and exact else 'FAIL'}", flush=True)
    return same and exact


EMBED_CASES = tuple((bits, gs, dtype) for bits in embed_rows.BITS for gs in embed_rows.GROUP_SIZES
                    for dtype in (mx.float32, mx.bfloat16))


def check_embeds(emu: EmbedRowsEmulator) -> list[bool]:
    """check_embed_rows over every width, group size and dtype (int32 ids), then the other id
    dtypes once (`--only embed` runs these alone)."""
    return ([check_embed_rows(emu, bits, gs, dtype=dtype) for bits, gs, dtype in EMBED_CASES]
            + [check_embed_rows(emu, 4, 64, dtype=mx.bfloat16, token_dtype=t) for t in (mx.uint32, mx.int64)])


def pieces_program(shim: str, backend: str, params: list[str], outputs: list[str], out_t: str, consts: str, body: str,
                   main: str) -> str:
    """A kernel whose outputs (of type `out_t`) are pooled pieces, behind `backend`'s prelude over
    `shim`, run by `main` (MAIN: a block's threads at once; MAIN_SERIAL: a thread at a time): every
    output a piece of the one buffer `main` writes, POOL_INTS values apart; inputs in `params`
    order from files."""
    args = ([f"({p.rsplit(' ', 1)[0]})in[{i}].data()" for i, p in enumerate(params)]
            + [f"out.data() + {pooled.POOL_INTS * j}" for j in range(len(outputs))])
    return (program(shim, backend, "", [*params, *(f"{out_t}* {o}" for o in outputs)], consts, body)
            + main.replace("NUM_INPUTS", str(len(params))).replace("OUT_T", out_t)
            .replace("CALL", f"kernel({', '.join(args)})"))


class PooledEmulator:
    """pooled's `join` and `split` on the CPU, a thread at a time (their threads never meet), with
    pooled's launch: int32 pieces joined, 4-byte values (int32, uint32, float32) split."""

    TYPES = {mx.int32: ("int32_t", np.int32), mx.uint32: ("uint32_t", np.uint32), mx.float32: ("float", np.float32)}

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}
        self.sources = {"join": pooled.join_source, "split": pooled.split_source}  # a check may swap one

    def _binary(self, kind: str, k: int, dtype) -> Path:
        """The body for k pieces (as on a GPU, one compile serves either length of the last)."""
        key = (kind, k, dtype)
        if key not in self.built:
            t = self.TYPES[dtype][0]
            if kind == "join":
                params, outputs = [f"const {t}* p{j}" for j in range(k)], ["out"]
            else:
                params, outputs = [f"const {t}* values"], [f"o{j}" for j in range(k)]
            source = pieces_program(SHIM_BLOCK, self.backend, params, outputs, t, "", self.sources[kind](k), MAIN_SERIAL)
            path = self.dir / f"pooled_{kind}_{k}_{t}_{len(self.built)}"
            compile_program(path, source)
            self.built[key] = path
        return self.built[key]

    def _run(self, kind: str, inputs: list[np.ndarray], n: int, dtype) -> np.ndarray:
        names = write_inputs(self.dir, "pin", inputs)
        config = pooled.launch(n)
        threads = config["threadgroup"][0]
        out = self.dir / "pout"
        binary = self._binary(kind, len(pooled.piece_shapes(n)), dtype)
        subprocess.run([str(binary), *names, str(config["grid"][0] // threads), "1", str(threads), str(n), str(out)],
                       check=True)
        return np.fromfile(out, self.TYPES[dtype][1])

    def join(self, pieces: list[np.ndarray]) -> np.ndarray:
        """`join`'s call, emulated: int32 pieces of POOL_INTS values (the last maybe fewer)."""
        return self._run("join", pieces, sum(p.size for p in pieces), mx.int32)

    def split(self, values: np.ndarray, dtype) -> list[np.ndarray]:
        """`split`'s call, emulated: the pieces' values (the buffers MLX would pool)."""
        out = self._run("split", [values], values.size, dtype)
        return [out[i : i + pooled.POOL_INTS] for i in range(0, values.size, pooled.POOL_INTS)]


def check_pooled(emu: PooledEmulator, counts=range(3, pooled.MAX_UPLOAD_INTS + 1)) -> list[bool]:
    """For every value count a window sends or reads back through the pool: `join` of int32 pieces
    gives the values in order, and `split` of int32, uint32 and float32 values gives pieces whose
    bits are the values' (negative ints, -0.0, infinities and NaN among them)."""
    results = []
    for n in counts:
        values = np.array(pooled.PROBE_INTS[:n], np.int32)
        joined = emu.join([values[i : i + pooled.POOL_INTS] for i in range(0, n, pooled.POOL_INTS)])
        results.append(("join int32", n, np.array_equal(joined, values)))
        for dtype, (_, np_type) in PooledEmulator.TYPES.items():
            source = pooled.PROBE_FLOATS if dtype == mx.float32 else pooled.PROBE_INTS
            values = np.array(source[:n], np.float32 if dtype == mx.float32 else np.int64).astype(np_type)
            pieces = emu.split(values, dtype)
            exact = (all(p.nbytes <= 8 for p in pieces)
                     and np.array_equal(np.concatenate(pieces).view(np.uint32), values.view(np.uint32)))
            results.append((f"split {np.dtype(np_type).name}", n, exact))
    for name, n, exact in results:
        print(f"pooled {name:27s} values {n:2d}  expected bits: {exact!s:5s}  {'ok' if exact else 'FAIL'}", flush=True)
    return [exact for *_, exact in results]


class ArgmaxEmulator:
    """argmax_rows' two kernels on the CPU, a block at a time (a warp's lanes at once: they
    shuffle), float32 or bfloat16 logits, with argmax_rows' launches."""

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}
        self.sources = {"chunks": lambda: argmax_rows.CHUNKS, "rows": argmax_rows.rows_source}  # a check may swap one

    def _binary(self, kind: str, dtype, pieces: int = 0) -> Path:
        key = (kind, dtype, pieces)
        if key not in self.built:
            t = EMULATED_TYPES[dtype][0]
            common = ["const int32_t* dims", "const float* neg_inf"]
            if kind == "chunks":
                params, outputs, out_t = [*common, f"const {t}* logits"], ["part"], "float"
                consts = (f"using T = {t}; constexpr int CHUNK = {argmax_rows.CHUNK}; "
                          f"constexpr int LANE_VALUES = {argmax_rows.LANE_VALUES};")
                body = self.sources["chunks"]()
            else:
                params, outputs, out_t, consts = [*common, "const float* part"], [f"o{j}" for j in range(pieces)], "uint32_t", ""
                body = self.sources["rows"](pieces)
            source = pieces_program(SHIM_BLOCK + BF16_SHIM, self.backend, params, outputs, out_t, consts, body, MAIN)
            path = self.dir / f"argmax_{kind}_{pieces}_{t}_{len(self.built)}"
            compile_program(path, source)
            self.built[key] = path
        return self.built[key]

    def chunks(self, logits: mx.array) -> np.ndarray:
        """The first kernel, emulated: logits (R, V) float32 or bfloat16 -> part (R, C, 2) float32."""
        R, V = logits.shape
        C, chunks, _ = argmax_rows.launches(R, V)
        names = write_inputs(self.dir, "ain", [np.array([R, V, C], np.int32), np.array([-np.inf], np.float32),
                                               raw_bits(logits)])
        part = self.dir / "apart"
        threads = chunks["threadgroup"][0]
        subprocess.run([str(self._binary("chunks", logits.dtype)), *names, str(chunks["grid"][0] // threads), str(R),
                        str(threads), str(R * C * 2), str(part)], check=True)
        return np.fromfile(part, np.float32).reshape(R, C, 2)

    def rows(self, part: np.ndarray, V: int) -> list[int]:
        """The second kernel, emulated: the chunks' part -> each row's token (4294967295 where the
        kernel left one unwritten), the pieces' values in order."""
        R, C, _ = part.shape
        _, _, rows = argmax_rows.launches(R, V)
        names = write_inputs(self.dir, "arin", [np.array([R, V, C], np.int32), np.array([-np.inf], np.float32), part])
        out = self.dir / "aout"
        subprocess.run([str(self._binary("rows", mx.float32, len(pooled.piece_shapes(R)))), *names, "1", str(R),
                        str(rows["threadgroup"][0]), str(R), str(out)], check=True)
        return np.fromfile(out, np.uint32).tolist()

    def run(self, logits: mx.array) -> list[int]:
        """`argmax_pieces`' two launches, emulated: each row's token."""
        return self.rows(self.chunks(logits), logits.shape[1])


def check_argmax(emu: ArgmaxEmulator) -> list[bool]:
    """For each probe width (a short last chunk; Qwen3-Next's 151,936), float32 and bfloat16:
    the tokens of the probe's 8 rows (ties across lanes and chunks, -inf, NaN, the largest first
    and last), of rows 5-7 and of each row alone are MLX's CUDA argmax's (`reference_argmax`)."""
    results = []
    for dtype in (mx.float32, mx.bfloat16):
        for V in argmax_rows.PROBE_COLUMNS:
            rows = argmax_rows.probe_rows(V, dtype)
            expected = argmax_rows.reference_argmax(rows)
            together = emu.run(rows)
            alone = [t for r in range(8) for t in emu.run(rows[r : r + 1])]
            ok = together == expected and alone == expected and emu.run(rows[5:]) == expected[5:]
            print(f"argmax_rows V={V:6d} {str(dtype).split('.')[-1]:8s} rows 8, 3, 1: {together}  "
                  f"{'ok' if ok else f'FAIL (expected {expected}, alone {alone})'}", flush=True)
            results.append(ok)
    return results


class CombineEmulator:
    """moe_combine's kernels on the CPU, float32 or bfloat16 picks (each element rounded as the
    GPU rounds it), with moe_combine's launch: a thread at a time (its threads never meet)."""

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}
        self.sources = {variant: body for variant, (_, _, body) in moe_combine.KERNELS.items()}

    def _binary(self, dtype, has_shared: bool, has_residual: bool) -> Path:
        key = (dtype, has_shared, has_residual)
        if key not in self.built:
            t = EMULATED_TYPES[dtype][0]
            _, inputs, body = moe_combine.KERNELS[has_shared, has_residual]
            types = {"dims": "const int32_t*", "weights": "const float*"}
            params = [f"{types.get(name, f'const {t}*')} {name}" for name in inputs]
            source = serial_program(self.backend, params, t, f"using T_P = {t};", self.sources[has_shared, has_residual])
            path = self.dir / f"combine_{t}_{int(has_shared)}{int(has_residual)}_{len(self.built)}"
            compile_program(path, source)
            self.built[key] = path
        return self.built[key]

    def run(self, picks: mx.array, weights: mx.array, *, normalize: bool = False, shared: mx.array | None = None,
            gates: mx.array | None = None, gate_column: int = 0, residual: mx.array | None = None) -> mx.array:
        """moe_combine's call, emulated: picks (R, k, H) float32 or bfloat16, weights (R, k)
        float32, shared (R, H) and gates (R, G), and residual (R, H), of the picks' dtype or None.
        Returns (R, H)."""
        R, k, H = picks.shape
        has_shared, has_residual = shared is not None, residual is not None
        G = gates.shape[-1] if has_shared else 1
        inputs = [np.array([R, k, H, int(normalize), G, gate_column], np.int32).tobytes(), raw_bits(picks).tobytes(),
                  raw_bits(weights.astype(mx.float32)).tobytes()]
        if has_shared:
            inputs += [raw_bits(shared).tobytes(), raw_bits(gates).tobytes()]
        if has_residual:
            inputs.append(raw_bits(residual).tobytes())
        names = write_inputs(self.dir, "cin", inputs)
        config = moe_combine.launch(R, H)
        threads = config["threadgroup"][0]
        out = self.dir / "cout"
        binary = self._binary(picks.dtype, has_shared, has_residual)
        subprocess.run([str(binary), *names, str(config["grid"][0] // threads), str(config["grid"][1]), str(threads),
                        str(R * H), str(out)], check=True)
        if picks.dtype == mx.bfloat16:
            return mx.array(np.fromfile(out, np.uint16).reshape(R, H)).view(mx.bfloat16)
        return mx.array(np.fromfile(out, np.float32).reshape(R, H))


def check_combine(emu: CombineEmulator, H: int, k: int, *, dtype=mx.float32, normalize: bool = True,
                  has_shared: bool = True, has_residual: bool = False, rows=range(1, 9), tol=1e-6,
                  seed: int = 0) -> bool:
    """For each R in `rows`: every row of an R-row call equals its 1-row call bit for bit, and
    the result is within one rounding of `dtype` (bfloat16; none for float32) plus `tol` of the
    row's largest value of the reference (moe_combine.reference_moe_combine). `has_residual`:
    the residual variant, whose rows must also equal MLX's add of the residual to the unfolded
    variant's rows bit for bit (reported with the row check), and which may be one rounding of
    the combine and one of the sum from the reference."""
    picks, weights, shared, gates = moe_combine.probe_inputs(H, k, rows=max(rows), dtype=dtype, seed=seed)
    residual = moe_combine.probe_residual(H, rows=max(rows), dtype=dtype, seed=seed)
    extra = {"shared": shared, "gates": gates, "gate_column": 1} if has_shared else {}

    def arrays(lo: int, hi: int, with_residual: bool = has_residual) -> dict:
        part = {**extra, "shared": shared[lo:hi], "gates": gates[lo:hi]} if has_shared else {}
        return {**part, "residual": residual[lo:hi]} if with_residual else part

    def call(lo: int, hi: int, with_residual: bool = has_residual) -> mx.array:
        return emu.run(picks[lo:hi], weights[lo:hi], normalize=normalize, **arrays(lo, hi, with_residual))

    def reference(R: int, with_residual: bool = has_residual) -> mx.array:
        return moe_combine.reference_moe_combine(picks[:R], weights[:R], normalize=normalize,
                                                 **arrays(0, R, with_residual))

    alone = mx.concatenate([call(t, t + 1) for t in range(max(rows))])
    ok = True
    for R in rows:
        got = call(0, R)
        same = mx.array_equal(got, alone[:R]).item() and not mx.isnan(got).any().item()
        g, e = _f32(got), _f32(reference(R))
        scale = np.abs(e)  # one output rounding; with the residual one of the combine too
        if has_residual:
            same = same and mx.array_equal(got, residual[:R] + call(0, R, with_residual=False)).item()
            scale = scale + np.abs(_f32(reference(R, with_residual=False)))
        excess = np.abs(g - e) - moe_combine.tolerance(dtype) * scale
        diff = float(np.max(excess / np.abs(e).max(axis=-1, keepdims=True)))
        name = (f"combine H={H} k={k} {str(dtype).split('.')[-1]}{' norm' if normalize else ''}"
                f"{' shared' if has_shared else ''}{' residual' if has_residual else ''}")
        ok &= _report(name, R, same, max(diff, 0.0), tol)
    return ok


COMBINE_CASES = ((2048, 10, mx.float32), (2048, 10, mx.bfloat16), (2048, 4, mx.bfloat16), (131, 4, mx.float32),
                 (131, 1, mx.bfloat16), (1000, 16, mx.float32))  # (H, k, dtype)


def check_combines(emu: CombineEmulator) -> list[bool]:
    """check_combine over COMBINE_CASES, each renormalising or not, with a shared expert or not,
    with the residual or not (`--only combine` runs these alone)."""
    return [check_combine(emu, H, k, dtype=dtype, normalize=normalize, has_shared=has_shared,
                          has_residual=has_residual)
            for H, k, dtype in COMBINE_CASES
            for normalize, has_shared in ((True, True), (False, False), (True, False), (False, True))
            for has_residual in (False, True)]


GLU_TOLERANCE = {mx.float32: 1e-5, mx.bfloat16: 2**-8}  # of the largest value: the sums' order, a rounding
GLU_PICKS = mx.array([3, 1, 3, 0, 3, 5, 3, 3], dtype=mx.uint32)  # expert 3: five of eight picks, shared blocks


def glu_case(kind: str, dtype, *, K: int, N: int, bits: int = 4, gs: int = 64, rows: int = 8, seed: int = 0):
    """Random operands of GLU kind `kind` at `dtype` for `rows` rows (picks): `inputs(i0, i1, which)`
    the launch's arrays over rows i0..i1-1 for "glu" or the plain kind's over "gate" or "up",
    `plain` the plain kind, `expected` the reference (kernels.reference_glu of the plain references)
    and the two plain references."""
    keys = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((rows, K), key=keys[0]).astype(dtype)
    gather = kind == "gather_glu"
    shape = (6, N, K) if gather else (N, K)
    gate, up = ((mx.random.normal(shape, key=k) * K**-0.5).astype(dtype) for k in keys[1:])
    experts = GLU_PICKS[:rows]
    wide = x.astype(mx.float32)  # the references in float32 (bfloat16 values widen exactly), as the kernel
    # sums (MLX would round a bfloat16 dequantization's weights first), each product rounded as the kernel rounds it
    if kind == "dense_glu":
        weights = {"gate": [gate], "up": [up]}
        refs = [kernels.reference_matvec(wide, w.astype(mx.float32)).astype(dtype) for w in (gate, up)]
    else:
        weights = {"gate": list(mx.quantize(gate, gs, bits)), "up": list(mx.quantize(up, gs, bits))}
        reference = kernels.reference_gather_qmatvec if gather else kernels.reference_qmatvec
        extra = (experts,) if gather else ()
        refs = [reference(wide, q, *(a.astype(mx.float32) for a in rest), *extra, group_size=gs, bits=bits)
                .astype(dtype) for q, *rest in (weights["gate"], weights["up"])]

    def arrays(a):
        return np.array(a) if a.dtype == mx.uint32 else raw_bits(a)

    def inputs(i0: int, i1: int, which: str) -> list:
        shapes = np.array([i1 - i0, K, N, 1] if gather else [i1 - i0, K, N], np.int32)
        ws = weights["gate"] + weights["up"] if which == "glu" else weights[which]
        return [shapes, raw_bits(x[i0:i1]), *map(arrays, ws), *([np.array(experts[i0:i1])] if gather else [])]

    return inputs, GLU_KINDS[kind], kernels.reference_glu(*refs), refs


def check_glu(emu: Emulator, kind: str, *, dtype=mx.float32, K: int = 512, N: int = 37, bits: int = 4, gs: int = 64,
              rows=range(1, 9)) -> bool:
    """For each R in `rows`: every row (pick) of an R-row call of GLU kind `kind` equals its
    1-row call bit for bit and stays within GLU_TOLERANCE (of the largest value) of the
    reference; at the largest R the call with the joining swapped for the gate alone, then the up
    alone, equals the plain kind's call bit for bit (each product is the plain kernel's float32
    sum, rounded as it rounds it). Printed too: how many values equal today's path's bits (the
    plain kernels' gate and up through MLX's compiled swiglu, here on the CPU)."""
    from strata_cli.model.layers import swiglu

    R_max = max(rows)
    inputs, plain, expected, _ = glu_case(kind, dtype, K=K, N=N, bits=bits, gs=gs, rows=R_max)
    gather = kind == "gather_glu"

    def run(i0: int, i1: int, which: str = "glu") -> np.ndarray:
        share = kernels.MAX_ROWS if gather and i1 - i0 > 1 else 1 if gather else i1 - i0
        return emu.launch(kind if which == "glu" else plain, inputs(i0, i1, which), rows=share,
                          blocks_y=i1 - i0 if gather else 1, N=N, out_rows=i1 - i0, bits=bits, gs=gs, dtype=dtype)

    alone = np.concatenate([run(i, i + 1) for i in range(R_max)])
    name = f"{kind} {bits if kind != 'dense_glu' else ''}{'-bit ' if kind != 'dense_glu' else ''}K={K} N={N} " \
           f"{str(dtype).split('.')[-1]}"
    ok = True
    for R in rows:
        got = run(0, R)
        e = _f32(expected[:R])
        ok &= _report(name, R, np.array_equal(got, alone[:R]), float(np.abs(got - e).max() / np.abs(e).max()),
                      GLU_TOLERANCE[dtype])
    glu, products = emu.glu, {}
    try:
        for which, joining in (("gate", "(G)"), ("up", "(U)")):
            emu.glu = f"#define STRATA_GLU(G, U) {joining}\n"
            products[which] = run(0, R_max, which)
            same = np.array_equal(run(0, R_max), products[which])
            print(f"{'':34s} {which} alone == the plain {plain} kernel's bits: {same}", flush=True)
            ok &= same
    finally:
        emu.glu = glu
    today = _f32(swiglu(*(mx.array(products[w]).astype(dtype) for w in ("gate", "up"))))
    got = run(0, R_max)
    print(f"{'':34s} bits == today's path (plain kernels, MLX's CPU swiglu): {int(np.sum(got == today))} of "
          f"{got.size}", flush=True)
    return ok


def check_glu_cols(emu: Emulator, *, cols=(1, 4), K: int = 2048, N: int = 37) -> list[bool]:
    """The routed GLU with other counts of output columns a warp (scripts/lab/glu_unroll.py's
    COLS): at each dtype every pick of an 8-pick call equals the default count's bits, at the
    80B's K (two chunks a lane, the loop unrolled by GLU_UNROLL)."""
    results = []
    for dtype in (mx.float32, mx.bfloat16):
        inputs, _, _, _ = glu_case("gather_glu", dtype, K=K, N=N)

        def run(c: int | None) -> np.ndarray:
            return emu.launch("gather_glu", inputs(0, 8, "glu"), rows=kernels.MAX_ROWS, blocks_y=8, N=N, out_rows=8,
                              bits=4, gs=64, cols=c, dtype=dtype)

        default = run(None)
        for c in cols:
            same = np.array_equal(run(c), default)
            print(f"gather_glu K={K} N={N} {str(dtype).split('.')[-1]:8s} {c} column(s) a warp == "
                  f"{kernels.GLU_COLS}'s bits: {same}  {'ok' if same else 'MISMATCH'}", flush=True)
            results.append(same)
    return results


# The tails the matrix kernels had before their reduce-scatter (rows_matvec._scatter_tail): each
# (row, column) value summed over the 32 lanes by the xor butterfly, five shuffles a value. The
# reduce-scatter must give their bits (`--only tails`).
BUTTERFLY_TAIL = """
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r >= R) break;
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            float v = acc[r][c];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += strata_xor(v, off);
            if (lane == c && n0 + c < N) out[static_cast<size_t>(row[r]) * N + n0 + c] = static_cast<T>(v);
        }
    }
"""
BUTTERFLY_GLU_TAIL = """
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (r >= R) break;
        #pragma unroll
        for (int c = 0; c < HALF; ++c) {
            float g = acc[r][c], v = acc[r][HALF + c];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) g += strata_xor(g, off);
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += strata_xor(v, off);
            if (lane == c && n0 + c < N) {
                const float gate = static_cast<float>(static_cast<T>(g)), up = static_cast<float>(static_cast<T>(v));
                out[static_cast<size_t>(row[r]) * N + n0 + c] = static_cast<T>(STRATA_GLU(gate, up));
            }
        }
    }
"""
TAIL_KINDS = ("dense", "quantized", "gather", "gather_mxfp4", "dense_glu", "quantized_glu", "gather_glu")


def _segmented(tail: str, row: str) -> str:
    """A tail whose write (of row `row`) lands where the column-mapped bodies write (rows_matvec._mapped)."""
    return tail.replace(f"out[static_cast<size_t>({row}) * N + n0 + c]", kernels._SEGMENT_OUT.replace("out_row", row))


def butterfly_kinds() -> dict:
    """KINDS with every matrix body's tail swapped for the butterfly's."""
    swapped = {}
    tails = ((kernels._GLU_TAIL, BUTTERFLY_GLU_TAIL), (kernels._TAIL, BUTTERFLY_TAIL),
             (_segmented(kernels._TAIL, "out_row"), _segmented(BUTTERFLY_TAIL, "row[r]")))
    for kind, (params, body, extra) in KINDS.items():
        for tail, butterfly in tails:
            if body.endswith(tail):
                body = body[: -len(tail)] + butterfly
                break
        else:
            raise AssertionError(f"{kind}: its body ends with neither tail")
        swapped[kind] = (params, body, extra)
    return swapped


def butterfly_bodies() -> dict[int, str]:
    """id(a matrix kind's body in KINDS) -> that body with the butterfly's tail, to swap bodies
    wherever they are held (rows_matvec's module, cuda_wrappers' list)."""
    old = butterfly_kinds()
    return {id(body): old[kind][1] for kind, (_, body, _) in KINDS.items()}


def tail_case(kind: str, dtype, *, K: int, N: int, rows: int = 8, seed: int = 0):
    """`inputs(i0, i1)` of kind `kind` (a TAIL_KINDS entry) over rows (picks) i0..i1-1 of `rows`
    random ones at `dtype` (affine 4-bit, groups of 64; routed experts pick GLU_PICKS)."""
    if kind in GLU_KINDS:
        inputs, *_ = glu_case(kind, dtype, K=K, N=N, rows=rows, seed=seed)
        return lambda i0, i1: inputs(i0, i1, "glu")
    keys = mx.random.split(mx.random.key(seed), 2)
    x = mx.random.normal((rows, K), key=keys[0]).astype(dtype)
    gather = kind.startswith("gather")
    w = (mx.random.normal((6, N, K) if gather else (N, K), key=keys[1]) * K**-0.5).astype(dtype)
    weights = ([w] if kind == "dense" else list(mx.quantize(w, 32, 4, mode="mxfp4")) if kind == "gather_mxfp4"
               else list(mx.quantize(w, 64, 4)))
    ws = [np.array(a) if a.dtype in (mx.uint32, mx.uint8) else raw_bits(a) for a in weights]

    def inputs(i0: int, i1: int) -> list:
        shape = [i1 - i0, K, N, 1] if kind == "gather" else [i1 - i0, K, N]
        return [np.array(shape, np.int32), raw_bits(x[i0:i1]), *ws,
                *([np.array(GLU_PICKS[i0:i1])] if gather else [])]

    return inputs


def check_tail(emu: Emulator, butterfly: Emulator, kind: str, *, dtype=mx.float32, K: int = 512, N: int = 37,
               rows=range(1, 9), cols: int | None = None) -> bool:
    """For each R in `rows`: kind `kind`'s R-row call (the routed kinds: R picks, up to 8 a block)
    equals, bit for bit, the same call through `butterfly` (an Emulator whose `kinds` are
    `butterfly_kinds()`). `cols`: output columns a warp (default: the kind's)."""
    inputs = tail_case(kind, dtype, K=K, N=N, rows=max(rows))
    gather = kind.startswith("gather")
    more = {"DECODE": 0, "PICKS_X": 1} if kind == "gather_mxfp4" else None
    ok = True
    for R in rows:
        got = [e.launch(kind, inputs(0, R), rows=R, blocks_y=R if gather else 1, N=N, out_rows=R, bits=4,
                        gs=32 if kind == "gather_mxfp4" else 64, cols=cols, more=more, dtype=dtype)
               for e in (emu, butterfly)]
        same = np.array_equal(got[0].view(np.uint32), got[1].view(np.uint32))
        print(f"{kind:14s} {str(dtype).split('.')[-1]:8s} cols {cols or 'default':7} rows {R}  "
              f"== the butterfly's bits: {same!s:5s} {'ok' if same else 'FAIL'}", flush=True)
        ok &= same
    return ok


def check_tails(emu: Emulator) -> list[bool]:
    """check_tail for every matrix kind in float32 and bfloat16, R = 1..8, and for the dense kind
    at 2 and 8 columns a warp (8 rows x 8 columns: two values a lane)."""
    butterfly = Emulator(emu.dir, emu.backend)
    butterfly.kinds = butterfly_kinds()
    results = [check_tail(emu, butterfly, kind, dtype=dtype) for kind in TAIL_KINDS
               for dtype in (mx.float32, mx.bfloat16)]
    return results + [check_tail(emu, butterfly, "dense", cols=cols, rows=(1, 3, 8)) for cols in (2, 8)]


MAPPED_TOLERANCE = GLU_TOLERANCE  # of the largest value: the sums' order, the output's rounding


def mapped_case(kind: str, dtype, *, K: int, N: int, bits: int = 4, gs: int = 64, rows: int = 8, seed: int = 0):
    """Random operands of column-mapped kind `kind` at `dtype` over N weight rows:
    `inputs(i0, i1, columns)` the launch's arrays over rows i0..i1-1 (the plain kind's without
    `columns`), and the plain reference (float32, rounded to `dtype`)."""
    keys = mx.random.split(mx.random.key(seed), 2)
    x = mx.random.normal((rows, K), key=keys[0]).astype(dtype)
    w = (mx.random.normal((N, K), key=keys[1]) * K**-0.5).astype(dtype)
    wide = x.astype(mx.float32)  # as the kernel sums: bfloat16 values widen exactly
    if kind == "dense_mapped":
        weights = [w]
        reference = kernels.reference_matvec(wide, w.astype(mx.float32))
    else:
        weights = list(mx.quantize(w, gs, bits))
        q, *rest = weights
        reference = kernels.reference_qmatvec(wide, q, *(a.astype(mx.float32) for a in rest), group_size=gs,
                                              bits=bits)

    def inputs(i0: int, i1: int, layout: columns_.ColumnLayout | None = None) -> list:
        n = N if layout is None else layout.N
        ws = [np.array(a) if a.dtype == mx.uint32 else raw_bits(a) for a in weights]
        return [np.array([i1 - i0, K, n], np.int32), raw_bits(x[i0:i1]), *ws,
                *([] if layout is None else [np.array(layout.data)])]

    return inputs, reference.astype(dtype)


def check_mapped(emu: Emulator, kind: str, *, dtype=mx.float32, K: int = 512, N: int = 38, bits: int = 4,
                 gs: int = 64, rows=range(1, 9), columns: mx.array | None = None, bounds=None) -> bool:
    """For each R in `rows`: every row of an R-row call of column-mapped kind `kind` (its
    segments side by side) equals its 1-row call bit for bit and the plain kind's R-row call with
    its columns gathered by the map bit for bit, and stays within MAPPED_TOLERANCE (of the largest
    value) of the reference. `columns`: the map, (n,) uint32 of values < N, and `bounds` its
    segments (default columns.probe_column_map and probe_bounds: every row reordered, three again,
    a column tail, three segments that split warps' columns)."""
    R_max = max(rows)
    inputs, reference = mapped_case(kind, dtype, K=K, N=N, bits=bits, gs=gs, rows=R_max)
    columns = columns_.probe_column_map(N) if columns is None else columns
    layout = columns_.ColumnLayout(columns, columns_.probe_bounds(columns.size) if bounds is None else bounds)
    plain = MAPPED_KINDS[kind]

    def run(i0: int, i1: int, kind_: str = kind) -> np.ndarray:
        if kind_ != kind:
            return emu.launch(kind_, inputs(i0, i1), rows=i1 - i0, blocks_y=1, N=N, out_rows=i1 - i0, bits=bits,
                              gs=gs, dtype=dtype)
        out = emu.launch(kind_, inputs(i0, i1, layout), rows=i1 - i0, blocks_y=1, N=layout.N, out_rows=i1 - i0,
                         bits=bits, gs=gs, dtype=dtype)
        return np.array(columns_.joined(layout.parts(mx.array(out.reshape(-1)), (i1 - i0,))))

    alone = np.concatenate([run(i, i + 1) for i in range(R_max)])
    expected = _f32(mx.take(reference, columns, axis=-1))
    name = f"{kind} {f'{bits}-bit ' if plain == 'quantized' else ''}K={K} N={N}->{columns.size} " \
           f"{len(layout.bounds) + 1} parts {str(dtype).split('.')[-1]}"
    ok = True
    for R in rows:
        got = run(0, R)
        gathered = np.array_equal(got, np.take(run(0, R, plain), np.array(columns), axis=-1))
        e = expected[:R]
        ok &= _report(name, R, np.array_equal(got, alone[:R]) and gathered,
                      float(np.abs(got - e).max() / np.abs(e).max()), MAPPED_TOLERANCE[dtype])
        print(f"{'':34s} == the plain {plain} kernel's columns, gathered: {gathered}", flush=True)
    return ok


MAPPED_CASES = (("dense_mapped", mx.float32, 4, 64), ("dense_mapped", mx.bfloat16, 4, 64),
                ("quantized_mapped", mx.float32, 4, 64), ("quantized_mapped", mx.bfloat16, 4, 64),
                ("quantized_mapped", mx.float32, 8, 32), ("quantized_mapped", mx.bfloat16, 8, 64))


def check_mappeds(emu: Emulator) -> list[bool]:
    """check_mapped over MAPPED_CASES (`--only mapped` runs these alone)."""
    return [check_mapped(emu, kind, dtype=dtype, bits=bits, gs=gs) for kind, dtype, bits, gs in MAPPED_CASES]


class AttentionPrepEmulator:
    """attention_prep's kernel on the CPU, a block (a row's head) at a time, the stacked projection,
    the norms' weights and the outputs in float32 or in bfloat16 (in software, BF16_SHIM)."""

    def __init__(self, workdir: Path, backend: str = backends.CUDA):
        self.dir, self.backend = workdir, backend
        self.built: dict[tuple, Path] = {}
        self.sources = {gate: body for gate, (_, _, body) in attention_prep.KERNELS.items()}

    def _binary(self, head_dim: int, dtype, gate: bool, norm: bool) -> Path:
        key = (head_dim, dtype, gate, norm, self.sources[gate])
        if key not in self.built:
            t = EMULATED_TYPES[dtype][0]
            params = ["const int32_t* dims", "const float* eps", "const int32_t* offset", f"const {t}* qkv",
                      f"const {t}* q_weight", f"const {t}* k_weight", "const float* inv_freq"]
            outputs = attention_prep.KERNELS[gate][1]
            consts = (f"using T = {t}; constexpr int PER = {attention_prep.per_thread(head_dim)}; "
                      f"constexpr int WARPS = {attention_prep.warps(head_dim)}; "
                      f"constexpr bool NORM = {str(norm).lower()};")
            source = block_program(SHIM_BLOCK + BF16_SHIM, self.backend, "", params, [(t, o) for o in outputs], consts,
                                   self.sources[gate])
            path = self.dir / f"attention_prep_{head_dim}_{t}_{int(gate)}{int(norm)}_{len(self.built)}"
            compile_program(path, source)
            self.built[key] = path
        return self.built[key]

    def run(self, qkv: mx.array, offset: int, *, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
            base: float, gate: bool, q_weight: mx.array | None = None, k_weight: mx.array | None = None,
            eps: float = 0.0) -> tuple[mx.array, ...]:
        """attention_prep's call, emulated (its arguments): q, k, v (and the gate) in qkv's dtype,
        the kernel's bits."""
        B, T, _ = qkv.shape
        D, dtype = head_dim, qkv.dtype
        bits = EMULATED_TYPES[dtype][1]
        norm = q_weight is not None
        unused = mx.zeros((1,), dtype=dtype)
        inputs = [np.array([T, num_heads, num_kv_heads, D, rotary_dim], np.int32), np.array([eps], np.float32),
                  np.full((B,), offset, np.int32), raw_bits(qkv), raw_bits(q_weight if norm else unused),
                  raw_bits(k_weight if norm else unused), _f32(attention_prep.inv_freq(rotary_dim, base))]
        names = write_inputs(self.dir, "ain", inputs)
        shapes = [(B, num_heads, T, D), (B, num_kv_heads, T, D), (B, num_kv_heads, T, D)]
        shapes += [(B, T, num_heads * D)] if gate else []
        config = attention_prep.launch(B * T, num_heads, num_kv_heads, D)
        threads = config["threadgroup"][0]
        sizes = []
        for i, shape in enumerate(shapes):
            words = -(-int(np.prod(shape)) * np.dtype(bits).itemsize // 4)  # the emulator's outputs are 4-byte words
            sizes += [str(words), str(self.dir / f"aout{i}")]
        subprocess.run([str(self._binary(D, dtype, gate, norm)), *names, str(config["grid"][0] // threads),
                        str(threads), *sizes], check=True)
        return tuple(mx.array(np.fromfile(self.dir / f"aout{i}", bits)[: int(np.prod(shape))].reshape(shape)).view(dtype)
                     for i, shape in enumerate(shapes))


def check_attention_prep(emu: AttentionPrepEmulator, num_heads: int, num_kv_heads: int, head_dim: int,
                         rotary_dim: int, *, gate: bool, norm: bool, rows=range(1, 9), dtype=mx.float32,
                         base: float = 1e7, offsets=(0, 4093), seed: int = 0, eps: float = 1e-6) -> bool:
    """For each R in `rows` and window offset p: every row t of an R-row call equals its 1-row call
    at offset p + t bit for bit, and every output is within attention_prep.TOLERANCE of the
    reference (relative to each head's largest value)."""
    qkv, qw, kw = attention_prep.probe_inputs(num_heads, num_kv_heads, head_dim, gate=gate, norm=norm,
                                              rows=max(rows), dtype=dtype, seed=seed)
    spec = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "rotary_dim": rotary_dim,
            "base": base, "gate": gate, "q_weight": qw, "k_weight": kw, "eps": eps}
    name = (f"attention_prep {num_heads}/{num_kv_heads}x{head_dim} rd {rotary_dim}{' gate' if gate else ''}"
            f"{' norm' if norm else ''} {str(dtype).split('.')[-1]}")
    ok = True
    for p in offsets:
        alone = [emu.run(qkv[:, t : t + 1], p + t, **spec) for t in range(max(rows))]
        for R in rows:
            outs = emu.run(qkv[:, :R], p, **spec)
            ref = attention_prep.reference_attention_prep(qkv[:, :R], p, **spec)
            same, diff = True, 0.0
            for i, (out, expected) in enumerate(zip(outs, ref)):
                axis = 1 if i == 3 else 2  # the gate is (B, T, Hq·D)
                rows_alone = np.concatenate([raw_bits(a[i]) for a in alone[:R]], axis=axis)
                same &= np.array_equal(raw_bits(out), rows_alone) and not np.isnan(_f32(out)).any()
                got, want = _f32(out), _f32(expected)
                largest = np.maximum(np.max(np.abs(want), axis=-1, keepdims=True), 1e-30)
                diff = max(diff, float(np.max(np.abs(got - want) / largest)))
            ok &= _report(f"{name} @{p}", R, same, diff, attention_prep.TOLERANCE[dtype])
    return ok


def _report(name: str, rows: int, same: bool, diff: float, tol: float) -> bool:
    ok = same and diff < tol
    print(f"{name:34s} rows {rows:2d}  identical to 1-row calls: {same!s:5s}  max rel diff {diff:.1e}  "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return ok


def _f32(a):
    return np.array(a.astype(mx.float32))


def check(name: str, run, rows: int, expected: np.ndarray, alone_rows) -> bool:
    """`run(i0, i1)`: the kernel over rows i0..i1-1 in one call."""
    together = run(0, rows)
    alone = np.concatenate([run(i, i + 1) for i in alone_rows])
    same = np.array_equal(together[list(alone_rows)], alone)
    diff = float(np.abs(together - expected).max())
    ok = same and diff < 1e-4
    print(f"{name:34s} rows {rows:2d}  identical to 1-row calls: {same!s:5s}  max |diff| {diff:.1e}  "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    return ok


CUDA_TYPES = {"float": "float", "bf16": "__nv_bfloat16"}
SPLITS_EMULATED = 1024  # attention_window.SPLIT_CELLS for the split checks and the nvcc compiles


@contextmanager
def split_cells(cells: int):
    """attention_window.SPLIT_CELLS set to `cells` inside (0: one kernel at every length)."""
    default, attention_window.SPLIT_CELLS = attention_window.SPLIT_CELLS, cells
    try:
        yield
    finally:
        attention_window.SPLIT_CELLS = default
ATTENTION_NVCC_HEADER = "#include <cuda/std/array>\nusing Strides = cuda::std::array<int64_t, 8>;\n"  # MLX's type


def cuda_wrappers() -> list[tuple[str, str, list[str], str, str]]:
    """(name, header, parameters, constants, body) of every kernel, as the CUDA backend builds them."""
    kernels_out = []
    for tn, t in CUDA_TYPES.items():
        x = f"const {t}* x"
        for r in (1, 8):  # serial decoding's compile and a window's
            rows = f"using T = {t}; constexpr int ROWS = {r}; constexpr int COLS = {kernels.COLS};"
            kernels_out += [
                (f"dense_r{r}_{tn}", kernels.HEADER, ["const int32_t* dims", x, f"const {t}* w", f"{t}* out"],
                 rows + f" using TW = {t};", kernels.DENSE),
                (f"quantized_r{r}_{tn}", kernels.HEADER, ["const int32_t* dims", x, "const uint32_t* w",
                                                          f"const {t}* scales", f"const {t}* biases", f"{t}* out"],
                 rows + f" using TS = {t}; constexpr int BITS = 4; constexpr int GS = 64;", kernels.QUANTIZED),
                (f"gather_r{r}_{tn}", kernels.HEADER, ["const int32_t* dims", x, "const uint32_t* w",
                                                       f"const {t}* scales", f"const {t}* biases",
                                                       "const uint32_t* idx", f"{t}* out"],
                 rows + f" using TS = {t}; using TI = uint32_t; constexpr int BITS = 4; constexpr int GS = 64;",
                 kernels.GATHER_QUANTIZED),
            ]
        kernels_out += [
            *((f"gather_mxfp4_{decode}_r{rows_}_{tn}", kernels.HEADER + kernels.MXFP4_HEADER,
               ["const int32_t* dims", x, "const uint32_t* w", "const uint8_t* scales", "const uint32_t* idx",
                f"{t}* out"],
               f"using T = {t}; using TI = uint32_t; constexpr int ROWS = {rows_}; constexpr int COLS = {kernels.COLS}; "
               f"constexpr int DECODE = {value}; constexpr int PICKS_X = 1;", kernels.GATHER_MXFP4)
              for decode, value in kernels.MXFP4_DECODES.items() for rows_ in ((1, 8) if value == 0 else (1,))),
            *((f"{kind}_r{rows_}_{tn}", kernels.HEADER + header,
               ["const int32_t* dims", x, *[p.replace("const float* ", f"const {t}* ") for p in KINDS[kind][0][2:]],
               f"{t}* out"],
              f"using T = {t}; {KINDS[kind][2].replace('float', t)} constexpr int ROWS = {rows_}; "
              f"constexpr int COLS = {cols};" + ("" if kind.startswith("dense_") else
                                                 " constexpr int BITS = 4; constexpr int GS = 64;"),
              KINDS[kind][1])
              for kinds, header, cols in ((GLU_KINDS, kernels.GLU_HEADER, 2 * kernels.GLU_COLS),
                                          (MAPPED_KINDS, "", kernels.COLS))
              for kind in kinds for rows_ in (1, 8)),
            (f"gdn_prepare_{tn}", gdn_window.HEADER,
             ["const int32_t* dims", f"const {t}* history", f"const {t}* raw", f"const {t}* conv_weight",
              f"const {t}* a", f"const {t}* b_in", "const float* A_log", "const float* dt_bias"]
             + [f"float* {n}" for n in GDN_KINDS["prepare"][1][:-1]] + [f"{t}* window_out"],
             f"using TX = {t}; using TW = {t}; using TA = {t}; using TB = {t}; using TL = float; using TD = float; "
             "constexpr int PER = 4; constexpr int KS = 4;", gdn_window.PREPARE),
        ]
        kernels_out.append((f"mamba2_prepare_{tn}", "",
                            ["const int32_t* dims", f"const {t}* history", f"const {t}* raw", f"const {t}* conv_weight",
                             f"const {t}* conv_bias", f"const {t}* dt_in", "const float* dt_bias", "const float* A_log",
                             "const float* limits"] + [f"float* {n}" for n in MAMBA2_KINDS["prepare"][1][:-1]]
                            + [f"{t}* window_out"],
                            " ".join(f"using T{i} = {u};" for i, u in enumerate((t, t, t, t, "float", "float")))
                            + " constexpr int KS = 4;", mamba2_window.PREPARE))
        for D in (64, 256):  # inputs passed as views: each with its strides, as MLX declares them
            params = ["const int32_t* dims", "const float* scale"]
            for name in ("q", "keys", "values"):
                params += [f"const {t}* {name}", f"const __grid_constant__ Strides {name}_strides"]
            consts = f"using TQ = {t}; using TK = {t}; using TV = {t}; constexpr int DH = {D};"
            kernels_out.append((f"attention_window_{D}_{tn}", ATTENTION_NVCC_HEADER + attention_window.header(),
                                params + [f"{t}* out"], consts, attention_window.SOURCE))
            # long views: the splits (float32 parts out) and their combine, with sinks and without
            for kind, split, combine, extra in (
                    ("", attention_window.SPLIT_SOURCE, attention_window.COMBINE_SOURCE, []),
                    ("_sinks", attention_window.SINK_SPLIT_SOURCE, attention_window.SINK_COMBINE_SOURCE,
                     [f"const {t}* sinks"])):
                header = ATTENTION_NVCC_HEADER + attention_window.split_header(SPLITS_EMULATED)
                kernels_out.append((f"attention_split{kind}_{D}_{tn}", header, params + extra + ["float* out"], consts,
                                    split))
                kernels_out.append((f"attention_combine{kind}_{D}_{tn}", header,
                                    ["const int32_t* dims", "const float* parts", *extra, f"{t}* out"], consts, combine))
        for E in (512, 48):  # Qwen3-Next-80B's router (PER 4) and the demo model's (PER 1)
            per = router_window.per_thread(E)
            kernels_out.append((f"router_window_{E}_{tn}", router_window.HEADER,
                                ["const int32_t* dims", f"const {t}* logits", "uint32_t* inds", "float* weights"],
                                f"using T_IN = {t}; constexpr int PER = {per};",
                                router_window.SOURCE))
        for H in (2048, 130):  # Qwen3-Next-80B's hidden size (PER 8) and an odd one (PER 1)
            kernels_out.append((f"add_norm_{H}_{tn}", add_norm.HEADER,
                                ["const int32_t* dims", "const float* eps", f"const {t}* x", f"const {t}* y",
                                 f"const {t}* weight", f"{t}* h", f"{t}* normed"],
                                f"using T = {t}; constexpr int PER = {add_norm.per_thread(H)};", add_norm.SOURCE))
        for G, D, gate_first in ((32, 128, False), (8, 1024, True), (3, 130, False)):  # 80B's GDN, Nemotron-H's groups
            kernels_out.append((f"gated_norm_{G}x{D}{'_gate_first' if gate_first else ''}_{tn}", "",
                                ["const int32_t* dims", "const float* eps", "const float* y", f"const {t}* z",
                                 f"const {t}* weight", f"{t}* out"],
                                f"using T = {t}; constexpr int PER = {gated_norm.per_thread(D)}; "
                                f"constexpr int WARPS = {gated_norm.warps(D)}; "
                                f"constexpr bool GATE_FIRST = {str(gate_first).lower()};", gated_norm.SOURCE))
        for D, gate, norm in ((256, True, True), (64, False, False), (512, False, True)):  # 80B's, a plain one, PER 2
            outputs = attention_prep.KERNELS[gate][1]
            kernels_out.append((f"attention_prep_{D}{'_gate' if gate else ''}{'_norm' if norm else ''}_{tn}", "",
                                ["const int32_t* dims", "const float* eps", "const int32_t* offset", f"const {t}* qkv",
                                 f"const {t}* q_weight", f"const {t}* k_weight", "const float* inv_freq"]
                                + [f"{t}* {o}" for o in outputs],
                                f"using T = {t}; constexpr int PER = {attention_prep.per_thread(D)}; "
                                f"constexpr int WARPS = {attention_prep.warps(D)}; "
                                f"constexpr bool NORM = {str(norm).lower()};", attention_prep.KERNELS[gate][2]))
        for bits, gs in ((4, 64), (2, 128), (8, 32)):  # Qwen3-Next-80B's embedding, and the other widths
            kernels_out.append((f"embed_rows_{bits}_{gs}_{tn}", "",
                                ["const int32_t* dims", "const int32_t* tokens", "const uint32_t* w",
                                 f"const {t}* scales", f"const {t}* biases", f"{t}* out"],
                                f"using T = {t}; using TI = int32_t; constexpr int BITS = {bits}; "
                                f"constexpr int GS = {gs};", embed_rows.SOURCE))
        for (has_shared, has_residual), (_, inputs, body) in moe_combine.KERNELS.items():  # row-major: no strides
            types = {"dims": "const int32_t*", "weights": "const float*"}
            variant = f"{'_shared' if has_shared else ''}{'_residual' if has_residual else ''}"
            kernels_out.append((f"moe_combine{variant}_{tn}", "",
                                [f"{types.get(name, f'const {t}*')} {name}" for name in inputs] + [f"{t}* out"],
                                f"using T_P = {t};", body))
    for n in (3, 8, pooled.MAX_UPLOAD_INTS):  # the pool's copies: 2, 4 and 8 pieces
        k = -(-n // pooled.POOL_INTS)
        kernels_out.append((f"pooled_join_{n}", "", [f"const int* p{j}" for j in range(k)] + ["int* out"], "",
                            pooled.join_source(k)))
        kernels_out.append((f"pooled_split_{n}", "", ["const float* values"] + [f"float* o{j}" for j in range(k)], "",
                            pooled.split_source(k)))
    for tn, t in (("f32", "float"), ("bf16", "__nv_bfloat16")):
        kernels_out.append((f"argmax_chunks_{tn}", "", ["const int32_t* dims", "const float* neg_inf",
                                                        f"const {t}* logits", "float* part"],
                            f"using T = {t}; constexpr int CHUNK = {argmax_rows.CHUNK}; "
                            f"constexpr int LANE_VALUES = {argmax_rows.LANE_VALUES};", argmax_rows.CHUNKS))
    kernels_out.append(("argmax_rows_4", "", ["const int32_t* dims", "const float* neg_inf", "const float* part"]
                        + [f"unsigned int* o{j}" for j in range(4)], "", argmax_rows.rows_source(4)))
    for dk in (64, 128, 256):
        kernels_out.append((f"gdn_scan_{dk}", gdn_window.HEADER,
                            ["const int32_t* dims"] + [f"const float* {n}" for n in GDN_KINDS["scan"][0][1:]]
                            + ["float* y", "float* S_out"],
                            f"constexpr int DK = {dk}; " + " ".join(f"using T{i} = float;" for i in range(6)),
                            gdn_window.SCAN))
    for ns in (64, 128, 256):
        kernels_out.append((f"mamba2_scan_{ns}", "",
                            ["const int32_t* dims"] + [f"const float* {n}" for n in MAMBA2_KINDS["scan"][0][1:]]
                            + ["float* y", "float* S_out"],
                            f"constexpr int NS = {ns}; " + " ".join(f"using T{i} = float;" for i in range(6)),
                            mamba2_window.SCAN))
    return kernels_out


def sass_instructions(cubin: Path) -> int:
    """The machine instructions of the one kernel in an sm_90 cubin, as placed (its .text
    section's bytes / 16: every loop unrolled and every branch counted once, none repeated)."""
    data = cubin.read_bytes()
    if data[:5] != b"\x7fELF\x02":
        raise ValueError(f"{cubin} is not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    size, count, names = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * size) for i in range(count)]
    table = sections[names][4]
    texts = [sec[5] for sec in sections if data.startswith(b".text.", table + sec[0])]
    if len(texts) != 1:
        raise ValueError(f"{cubin} holds {len(texts)} kernels' code, not one")
    return texts[0] // 16


def nvcc_compile(path: Path, header: str, params: list[str], consts: str, body: str, *,
                 count: bool = False) -> tuple[subprocess.CompletedProcess, dict | None]:
    """A kernel `body` as the CUDA backend wraps it (its header, `params`, the template values
    as `consts`), written to `path` (.cu) and compiled for sm_90 by nvcc: the run, and ptxas's
    registers, stack and spill bytes a thread (None where it printed none); `count`: its machine
    instructions too (`sass_instructions`, a second compile to a cubin)."""
    path.write_text("#include <cstdint>\n#include <cuda_bf16.h>\n#include <cooperative_groups.h>\n"
                    + backends.header(backends.CUDA, header)
                    + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
                    + f"__global__ void custom_kernel_{path.stem}({', '.join(params)}) {{\n{consts}\n"
                    + f"{backends.source(backends.CUDA, body)}\n}}\n}}\n")
    run = subprocess.run(["nvcc", "-arch=sm_90", "-c", str(path), "-o", str(path.with_suffix(".o")),
                          "-Xptxas", "-v"], capture_output=True, text=True)
    registers = re.findall(r"Used (\d+) registers", run.stderr)
    stack = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    if not (registers and stack):
        return run, None
    found = {"registers": int(registers[-1]), "stack": int(stack[-1][0]), "spill_stores": int(stack[-1][1]),
             "spill_loads": int(stack[-1][2])}
    if count:
        cubin = path.with_suffix(".cubin")
        subprocess.run(["nvcc", "-arch=sm_90", "-cubin", str(path), "-o", str(cubin)], capture_output=True, check=True)
        found["instructions"] = sass_instructions(cubin)
    return run, found


def nvcc_check(workdir: Path, *, butterfly: bool = False) -> bool:
    """Compile every kernel body for sm_90 (a file per kernel: each header stands alone) and print
    ptxas's registers, stack and spills and the PTX's warp shuffles per kernel. `butterfly`: the
    matrix bodies with the tail they had before their reduce-scatter (BUTTERFLY_TAIL)."""
    old = butterfly_bodies() if butterfly else {}
    ok = True
    for name, header, params, consts, body in cuda_wrappers():
        path = workdir / f"{name}.cu"
        run, found = nvcc_compile(path, header, params, consts, old.get(id(body), body))
        ptx = subprocess.run(["nvcc", "-arch=sm_90", "-ptx", str(path), "-o", str(path.with_suffix(".ptx"))],
                             capture_output=True, text=True)
        shuffles = (sum("shfl.sync" in line for line in path.with_suffix(".ptx").read_text().splitlines())
                    if ptx.returncode == 0 else "?")
        figures = (f"{found['registers']} registers, {found['stack']} B stack, {shuffles} shuffles, spills "
                   f"{found['spill_stores']}/{found['spill_loads']} B" if found else "")
        print(f"nvcc sm_90 {name:28s} {'ok' if run.returncode == 0 else 'FAIL'}  {figures}", flush=True)
        if run.returncode:
            print(run.stderr, flush=True)
        ok &= run.returncode == 0
    return ok


# `--only`: the checks of one kernel, given the matrix emulator and the backend
ONLY = {
    "combine": lambda emu, backend: check_combines(CombineEmulator(emu.dir, backend)),
    "mapped": lambda emu, backend: check_mappeds(emu),
    "embed": lambda emu, backend: check_embeds(EmbedRowsEmulator(emu.dir, backend)),
    "tails": lambda emu, backend: check_tails(emu),
    "glu-cols": lambda emu, backend: check_glu_cols(emu),
    "pooled": lambda emu, backend: check_pooled(PooledEmulator(emu.dir, backend)),
    "argmax": lambda emu, backend: check_argmax(ArgmaxEmulator(emu.dir, backend)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=backends.BACKENDS, default=backends.CUDA,
                        help="whose prelude the bodies run behind (default: cuda)")
    parser.add_argument("--nvcc", action="store_true",
                        help="compile the bodies with nvcc for sm_90 instead (registers, stack, spills, shuffles)")
    parser.add_argument("--butterfly-tail", action="store_true",
                        help="with --nvcc: the matrix bodies with their old tail (a butterfly per value), to compare")
    parser.add_argument("--only", choices=ONLY,
                        help="run one kernel's checks alone: combine (metal_shaders/moe_combine.py, a few minutes), "
                             "mapped (rows_matvec's column-mapped forms, about a minute), embed "
                             "(metal_shaders/embed_rows.py, seconds), tails (rows_matvec's reduce-scatter "
                             "against the butterfly, every matrix kind, a few minutes), glu-cols (the routed "
                             "GLU at other columns a warp), pooled (metal_shaders/pooled.py's copies, seconds) or "
                             "argmax (metal_shaders/argmax_rows.py, seconds)")
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    emu = Emulator(Path(tempfile.mkdtemp(prefix="strata-kernel-emulate-")), args.backend)
    if args.nvcc:
        ok = nvcc_check(emu.dir, butterfly=args.butterfly_tail)
        print("every body compiles" if ok else "COMPILE FAILURE", flush=True)
        return 0 if ok else 1
    if args.only:
        ok = all(ONLY[args.only](emu, args.backend))
        print("all kernels match" if ok else "MISMATCH", flush=True)
        return 0 if ok else 1
    results = []
    for K, N, bits, gs, R in ((512, 37, 4, 64, 3), (2048, 21, 4, 64, 8), (1024, 19, 8, 32, 2)):
        x = mx.random.normal((R, K), key=mx.random.key(1))
        qw, qs, qb = mx.quantize(mx.random.normal((N, K), key=mx.random.key(2)) * K**-0.5, gs, bits)

        def run(i0, i1, x=x, qw=qw, qs=qs, qb=qb, K=K, N=N, bits=bits, gs=gs):
            return emu.launch("quantized", [np.array([i1 - i0, K, N], np.int32), _f32(x[i0:i1]), np.array(qw),
                                            _f32(qs), _f32(qb)], rows=i1 - i0, blocks_y=1, N=N, out_rows=i1 - i0,
                              bits=bits, gs=gs)

        expected = _f32(kernels.reference_qmatvec(x, qw, qs, qb, group_size=gs, bits=bits))
        results.append(check(f"rows_qmatvec {bits}-bit K={K} N={N}", run, R, expected, range(R)))

    K, N, R = 256, 23, 5
    x = mx.random.normal((R, K), key=mx.random.key(3))
    w = mx.random.normal((N, K), key=mx.random.key(4)) * K**-0.5

    def run_dense(i0, i1):
        return emu.launch("dense", [np.array([i1 - i0, K, N], np.int32), _f32(x[i0:i1]), _f32(w)],
                          rows=i1 - i0, blocks_y=1, N=N, out_rows=i1 - i0)

    results.append(check(f"rows_matvec K={K} N={N}", run_dense, R, _f32(kernels.reference_matvec(x, w)), range(R)))

    K, N, E = 512, 40, 6
    experts = mx.array([3, 1, 3, 0, 3, 5, 1, 3, 3, 3, 3, 3], dtype=mx.uint32)  # expert 3: 9 picks
    M = experts.shape[0]
    xg = mx.random.normal((M, K), key=mx.random.key(5))
    qw, qs, qb = mx.quantize(mx.random.normal((E, N, K), key=mx.random.key(6)) * K**-0.5, 64, 4)

    def run_gather(i0, i1):
        return emu.launch("gather", [np.array([i1 - i0, K, N, 1], np.int32), _f32(xg[i0:i1]), np.array(qw), _f32(qs),
                                     _f32(qb), np.array(experts[i0:i1])],
                          rows=kernels.MAX_ROWS if i1 - i0 > 1 else 1, blocks_y=i1 - i0, N=N, out_rows=i1 - i0, bits=4, gs=64)

    expected = _f32(kernels.reference_gather_qmatvec(xg, qw, qs, qb, experts, group_size=64, bits=4))
    results.append(check(f"rows_gather_qmatvec K={K} N={N}", run_gather, M, expected, (0, 5, 8, 11)))
    fw, fs = mx.quantize(mx.random.normal((E, N, K), key=mx.random.key(7)) * K**-0.5, 32, 4, mode="mxfp4")
    expected = _f32(kernels.reference_gather_mxfp4matvec(xg, fw, fs, experts))
    for decode, value in kernels.MXFP4_DECODES.items():  # each form, 8 picks a block (expert 3: 9 picks)
        def run_mxfp4(i0, i1, value=value):
            return emu.launch("gather_mxfp4", [np.array([i1 - i0, K, N], np.int32), _f32(xg[i0:i1]), np.array(fw),
                                               np.array(fs), np.array(experts[i0:i1])],
                              rows=kernels.MAX_ROWS if i1 - i0 > 1 else 1, blocks_y=i1 - i0, N=N, out_rows=i1 - i0,
                              more={"DECODE": value, "PICKS_X": value % 2})  # both grid orders

        results.append(check(f"rows_gather_mxfp4matvec {decode} K={K} N={N}", run_mxfp4, M, expected, (0, 5, 8, 11)))
    for kind, dtype, bits, gs in (("dense_glu", mx.float32, 4, 64), ("dense_glu", mx.bfloat16, 4, 64),
                                  ("quantized_glu", mx.float32, 4, 64), ("quantized_glu", mx.bfloat16, 4, 64),
                                  ("quantized_glu", mx.float32, 8, 32), ("gather_glu", mx.float32, 4, 64),
                                  ("gather_glu", mx.bfloat16, 4, 64)):
        results.append(check_glu(emu, kind, dtype=dtype, bits=bits, gs=gs))
    results += check_glu_cols(emu)
    results += check_mappeds(emu)
    results += check_tails(emu)
    gdn = GDNEmulator(emu.dir, args.backend)
    for B, Hk, Hv, Dk, Dv in ((1, 16, 32, 128, 128), (1, 2, 4, 64, 64), (2, 1, 1, 32, 64)):
        results.append(check_gdn(gdn, B, Hk, Hv, Dk, Dv))
    mamba2 = Mamba2Emulator(emu.dir, args.backend)
    for B, H, P, G, N, bias in ((1, 64, 64, 8, 128, True), (1, 4, 32, 1, 16, False), (2, 4, 16, 2, 64, True)):
        results.append(check_mamba2(mamba2, B, H, P, G, N, bias=bias))
    attention = AttentionEmulator(emu.dir, args.backend)
    sinks = SinkAttentionEmulator(emu.dir, args.backend)
    with split_cells(0):  # one kernel at every length, 5,000 cells included
        for B, Hq, Hkv, D, cells in ((1, 16, 2, 256, 1), (1, 16, 2, 256, 7), (1, 16, 2, 256, 300), (1, 4, 2, 64, 1),
                                     (1, 4, 2, 64, 7), (1, 4, 2, 64, 300), (1, 4, 2, 64, 5000),
                                     (1, 2, 1, 256, 5000), (2, 4, 1, 64, 40)):
            results.append(check_attention(attention, B, Hq, Hkv, D, cells))
        for B, Hq, Hkv, D, cells, window, pos0 in ((1, 64, 8, 64, 135, 128, 3000), (1, 64, 8, 64, 135, 128, 4),
                                                   (1, 8, 2, 64, 300, 0, 0), (2, 4, 2, 64, 11, 4, 37)):
            results.append(check_sink_attention(sinks, B, Hq, Hkv, D, cells, window, pos0=pos0))
    with split_cells(SPLITS_EMULATED):  # long views in splits: across the threshold, and far past it
        for B, Hq, Hkv, D, cells in ((1, 4, 2, 64, 1020), (1, 4, 2, 64, 5000), (1, 2, 1, 256, 5000)):
            results.append(check_attention(attention, B, Hq, Hkv, D, cells))
        for offset in (0.0, 6.0):  # 6: the sinks above every score
            results.append(check_sink_attention(sinks, 1, 8, 2, 64, 1020, 0, pos0=0, sink_offset=offset))
    router = RouterEmulator(emu.dir, args.backend)
    for E, k, dtype in ((512, 10, mx.float32), (512, 10, mx.bfloat16), (48, 2, mx.float32), (48, 2, mx.bfloat16),
                        (1024, 16, mx.float32), (130, 8, mx.float32)):
        results.append(check_router(router, E, k, dtype=dtype))
    add_norms = AddNormEmulator(emu.dir, args.backend)
    for H, dtype in ((2048, mx.float32), (2048, mx.bfloat16), (130, mx.float32), (130, mx.bfloat16)):
        results.append(check_add_norm(add_norms, H, dtype=dtype))
    gated_norms = GatedNormEmulator(emu.dir, args.backend)
    for G, D, dtype, gate_first, tiled in ((32, 128, mx.float32, False, False), (32, 128, mx.bfloat16, False, False),
                                           (32, 128, mx.bfloat16, False, True), (3, 130, mx.float32, False, True),
                                           (3, 130, mx.bfloat16, False, False), (8, 1024, mx.bfloat16, True, True),
                                           (2, 1000, mx.float32, True, True), (1, 37, mx.float32, False, False)):
        results.append(check_gated_norm(gated_norms, G, D, dtype=dtype, gate_first=gate_first, tiled=tiled))
    preps = AttentionPrepEmulator(emu.dir, args.backend)
    for Hq, Hkv, D, RD, gate, norm, dtype in ((16, 2, 256, 64, True, True, mx.float32),
                                              (16, 2, 256, 64, True, True, mx.bfloat16),
                                              (4, 2, 64, 64, False, False, mx.float32),
                                              (4, 2, 64, 64, False, False, mx.bfloat16),
                                              (3, 1, 130, 32, True, False, mx.float32),
                                              (2, 1, 512, 128, False, True, mx.bfloat16)):
        results.append(check_attention_prep(preps, Hq, Hkv, D, RD, gate=gate, norm=norm, dtype=dtype))
    results += check_combines(CombineEmulator(emu.dir, args.backend))
    results += check_embeds(EmbedRowsEmulator(emu.dir, args.backend))
    results += check_pooled(PooledEmulator(emu.dir, args.backend))
    results += check_argmax(ArgmaxEmulator(emu.dir, args.backend))
    print("all kernels match" if all(results) else "MISMATCH", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
