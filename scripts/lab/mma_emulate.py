"""The tensor-core kernels of metal_shaders/rows_mma.py on the CPU: their bodies compiled with g++
by kernel_emulate.py's machinery, `mma.sync.m16n8k16` and the bf16 pair conversion in software.

The software MMA gathers the warp's fragments through the warp's barrier and gives each lane its
D elements from the PTX ISA's fragment layout (A (16 x 16), B (16 x 8), D (16 x 8)), each
element's 16 products summed in order in float32. So a wrong fragment index, a lane that reads
the wrong chunk or row, or a row that leaks into another shows here as on the GPU; the tensor
core's own rounding of the sum does not (its row invariance is the probe's to check on the device).

    python -m scripts.lab.mma_emulate   # every probe case of rows_mma, as the device probe runs them
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from metal_shaders import backends, rows_mma
from scripts.lab.kernel_emulate import BF16_SHIM, MAIN, SHIM_BLOCK, compile_program, program, raw_bits, write_inputs

MMA_SHIM = r"""
unsigned mma_slots[MAX_WARPS][32][6];
inline float strata_bits_float(unsigned u) { return __uint_as_float(u); }
inline unsigned strata_bf16x2(float lo, float hi) {
    return static_cast<unsigned>(strata_bf16(lo).bits) | (static_cast<unsigned>(strata_bf16(hi).bits) << 16);
}
inline float strata_pair_half(unsigned pair, int half) {
    strata_bf16 v; v.bits = static_cast<uint16_t>(half ? pair >> 16 : pair & 0xffffu); return static_cast<float>(v);
}
inline void strata_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    warp_barriers[w]->arrive_and_wait();
    const unsigned mine[6] = {a0, a1, a2, a3, b0, b1};
    for (int i = 0; i < 6; ++i) mma_slots[w][lane][i] = mine[i];
    warp_barriers[w]->arrive_and_wait();
    // A (row, k): lane 4 (row % 8) + (k % 8) / 2, register (row >= 8) + 2 (k >= 8), half k % 2;
    // B (k, col): lane 4 col + (k % 8) / 2, register 4 + (k >= 8), half k % 2
    auto A = [&](int row, int k) { return strata_pair_half(mma_slots[w][4 * (row % 8) + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k % 2); };
    auto B = [&](int k, int col) { return strata_pair_half(mma_slots[w][4 * col + (k % 8) / 2][4 + (k >= 8)], k % 2); };
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >= 2), col = 2 * q + (i & 1);
        float s = 0.0f;
        for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
        out[i] = d[i] + s;
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}
"""
C_TYPES = {mx.int32: "int32_t", mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.bfloat16: "strata_bf16",
           mx.float32: "float"}


def _bytes(a: mx.array) -> np.ndarray:
    return raw_bits(a) if a.dtype in (mx.bfloat16, mx.float32) else np.array(a)


class MmaEmulator:
    """A stand-in for rows_mma's `gpu_kernel`: each launch compiled (once per body and template)
    and run on the CPU, a block at a time with its threads side by side."""

    def __init__(self, workdir: Path):
        self.dir = workdir
        self.launches = 0

    def gpu_kernel(self, name, inputs, outputs, body, header="", *, ensure_row_contiguous=True):
        assert outputs == ["out"] and ensure_row_contiguous
        assert header == rows_mma.header(), "the bodies are emulated behind rows_mma's own header"

        def launch(*, inputs: list, template, grid, threadgroup, output_shapes, output_dtypes):
            arrays = list(inputs)
            params = [f"const {C_TYPES[a.dtype]}* {n}" for n, a in zip(input_names, arrays, strict=True)]
            t = C_TYPES[output_dtypes[0]]
            consts = " ".join(f"using {k} = {C_TYPES[v]};" if isinstance(v, mx.Dtype) else
                              f"constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};"
                              for k, v in template)
            args = ", ".join(f"({p.rsplit(' ', 1)[0]})in[{i}].data()" for i, p in enumerate(params))
            source = (program(SHIM_BLOCK + BF16_SHIM + MMA_SHIM, backends.CUDA, rows_mma.header(helpers=""),
                              [*params, f"{t}* out"], consts, body)
                      + MAIN.replace("NUM_INPUTS", str(len(params))).replace("OUT_T", t)
                      .replace("CALL", f"kernel({args}, out.data())"))
            binary = self.dir / f"{name}_{self.launches}"
            compile_program(binary, source)
            names = write_inputs(self.dir, f"{name}_in", [_bytes(a) for a in arrays])
            threads = threadgroup[0]
            size = int(np.prod(output_shapes[0]))
            out = self.dir / f"{name}_out"
            subprocess.run([str(binary), *names, str(grid[0] // threads), str(grid[1]), str(threads), str(size),
                            str(out)], check=True)
            self.launches += 1
            raw = np.fromfile(out, np.uint16 if t == "strata_bf16" else np.float32)
            result = mx.array(raw)
            if t == "strata_bf16":
                result = result.view(mx.bfloat16)
            return [result.reshape(output_shapes[0])]

        input_names = inputs
        return launch


def run_probe_cases(workdir: Path, names: tuple[str, ...] = ()) -> dict[str, str | None]:
    """Every probe case of rows_mma (or those named) through the emulator: what -> None (passed)
    or what failed."""
    emu = MmaEmulator(workdir)
    original = rows_mma.gpu_kernel
    rows_mma.gpu_kernel = emu.gpu_kernel
    try:
        return {what: rows_mma.check_case(kernel, ref, x, experts)
                for what, kernel, ref, x, experts in rows_mma.probe_cases() if not names or what in names}
    finally:
        rows_mma.gpu_kernel = original


def main(argv: list[str] | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="strata-mma-emulate-") as tmp:
        results = run_probe_cases(Path(tmp), tuple(argv if argv is not None else sys.argv[1:]))
    for what, error in results.items():
        print(f"{what}: {error or 'rows invariant, near the reference'}")
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
