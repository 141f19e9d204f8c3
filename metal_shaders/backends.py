"""One kernel body, two GPU backends: the thin preludes that let a body of metal_shaders compile
for CUDA (`mx.fast.cuda_kernel`) and for Metal (`mx.fast.metal_kernel`).

A body is written once, in the C++ both dialects share (no address-space words, `auto` for
derived pointers, templates on pointer types), and names only what every prelude defines:

- `thread_x`, `block_x`, `block_y`, `block_dim`: the thread's index in its block, the block's
  index in the grid, the block's size. They are the body's first lines (`START`): on Metal they
  name MLX's kernel attributes, and naming them in the source is how `metal_kernel` knows to
  pass them.
- `STRATA_SHARED` (an array the block shares), `strata_sync()` (block barrier),
  `strata_sync_warp()` (warp / SIMD-group barrier);
- `strata_xor(v, offset)`: v from the lane `offset` away, the step of a xor butterfly over a
  32-lane warp (CUDA) or SIMD group (Apple GPUs: 32 lanes too);
- loads: `strata_load<V, N>(p, vec, out)` (N values as floats), `strata_words(p, vec)` (4 packed
  words), `strata_aligned16(p, row_bytes)` (whether 16-byte loads may be used: only CUDA uses
  them; the values and the arithmetic are the same either way), `strata_u2f` (a small unsigned
  int as an exact float), `strata_quant<BITS>(word, j)` (field j of a word of BITS-bit fields,
  low first, as an exact float; BITS 4 or 8), `strata_exp2i(e)` (2^e as a float, exact), `strata_e8m0(s)` (an MX
  scale byte, 2^(s - 127)), `strata_f16lo(h)` / `strata_f16hi(h)` (the fp16 in h's low / high
  half as a float, exact);
- the float math of CUDA's spelling (`expf`, `fmaf`, `fmaxf`, `fabsf`, `sqrtf`, `rsqrtf`,
  `log1pf`, `sinf`, `cosf`), which Metal spells `metal::exp`, ... (MLX compiles Metal with fast
  math off, so `fma` stays one rounding and no sum is reassociated).

Row invariance is a property of the body (a fixed order of float32 operations per row), so it
holds on both backends by construction; each kernel's probe checks it on the running device
before first use, and `strata selftest` checks whole decodes.
"""

from __future__ import annotations

CUDA, METAL = "cuda", "metal"

_CUDA_HEADER = r"""
#define STRATA_SHARED __shared__
__device__ __forceinline__ void strata_sync() { __syncthreads(); }
__device__ __forceinline__ void strata_sync_warp() { __syncwarp(); }
__device__ __forceinline__ float strata_xor(float v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }
// 2^23 + q has q in its mantissa: exact, without the slow integer-to-float instruction
__device__ __forceinline__ float strata_u2f(unsigned int q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }
// field j of a word of BITS-bit fields, read in place from its 16-bit half: the field is the
// mantissa of 2^(23 - shift) + field, and that power is taken off (with j known when it
// compiles, one logic op and a subtraction where a shift, a logic op and a subtraction were)
template <int BITS>
__device__ __forceinline__ float strata_quant(unsigned int word, int j) {
    constexpr int HALF = 16 / BITS;  // fields a half
    const unsigned int bits = j < HALF ? word : word >> 16, shift = BITS * (j % HALF);
    const unsigned int power = (150u - shift) << 23;  // 2^(23 - shift)
    return __uint_as_float(power | (bits & (((1u << BITS) - 1u) << shift))) - __uint_as_float(power);
}
__device__ __forceinline__ float strata_exp2i(int e) { return ldexpf(1.0f, e); }
// an e8m0 scale byte: 2^(s - 127) (s = 0: the subnormal 2^-127), without ldexpf's special cases
__device__ __forceinline__ float strata_e8m0(unsigned int s) { return __uint_as_float(s ? s << 23 : 0x00400000u); }
// the half in the low / high 16 bits of h, as a float (exact, subnormals included)
__device__ __forceinline__ float strata_f16lo(unsigned int h) { return __half2float(__ushort_as_half(static_cast<unsigned short>(h))); }
__device__ __forceinline__ float strata_f16hi(unsigned int h) { return __half2float(__ushort_as_half(static_cast<unsigned short>(h >> 16))); }
template <typename P>
__device__ __forceinline__ bool strata_aligned16(P p, size_t row_bytes) {
    return ((reinterpret_cast<size_t>(p) | row_bytes) & 15) == 0;
}
template <typename V, int N>
__device__ __forceinline__ void strata_load(const V* p, bool vec, float* out) {
    constexpr int PER = 16 / static_cast<int>(sizeof(V));
    if constexpr (N % PER == 0) {
        if (vec) {
            #pragma unroll
            for (int i = 0; i < N / PER; ++i) {
                const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + i);
                const V* v = reinterpret_cast<const V*>(&raw);
                #pragma unroll
                for (int j = 0; j < PER; ++j) out[i * PER + j] = static_cast<float>(v[j]);
            }
            return;
        }
    }
    #pragma unroll
    for (int j = 0; j < N; ++j) out[j] = static_cast<float>(p[j]);
}
__device__ __forceinline__ uint4 strata_words(const unsigned int* p, bool vec) {
    return vec ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(p[0], p[1], p[2], p[3]);
}
"""
_CUDA_START = "    const int thread_x = threadIdx.x, block_x = blockIdx.x, block_y = blockIdx.y, block_dim = blockDim.x;\n"

# Metal: pointers carry an address space (device, constant, thread), so the helpers take any
# pointer type; loads are scalar (the values, and so the arithmetic, are those of CUDA's 16-byte
# loads).
_METAL_HEADER = r"""
#define STRATA_SHARED threadgroup
inline void strata_sync() { metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup); }
inline void strata_sync_warp() { metal::simdgroup_barrier(metal::mem_flags::mem_threadgroup); }
inline float strata_xor(float v, int offset) { return metal::simd_shuffle_xor(v, static_cast<ushort>(offset)); }
inline float strata_u2f(unsigned int q) { return static_cast<float>(q); }
template <int BITS>
inline float strata_quant(unsigned int word, int j) {
    return static_cast<float>((word >> (BITS * j)) & ((1u << BITS) - 1u));
}
inline float strata_exp2i(int e) { return metal::ldexp(1.0f, e); }
inline float strata_e8m0(unsigned int s) { return as_type<float>(s ? s << 23 : 0x00400000u); }
inline float strata_f16lo(unsigned int h) { return static_cast<float>(as_type<half>(static_cast<ushort>(h))); }
inline float strata_f16hi(unsigned int h) { return static_cast<float>(as_type<half>(static_cast<ushort>(h >> 16))); }
template <typename P>
inline bool strata_aligned16(P, size_t) { return false; }
template <typename V, int N, typename P, typename O>
inline void strata_load(P p, bool, O out) {
    for (int j = 0; j < N; ++j) out[j] = static_cast<float>(p[j]);
}
template <typename P>
inline uint4 strata_words(P p, bool) { return uint4(p[0], p[1], p[2], p[3]); }
inline float expf(float x) { return metal::exp(x); }
inline float fmaf(float a, float b, float c) { return metal::fma(a, b, c); }
inline float fmaxf(float a, float b) { return metal::fmax(a, b); }
inline float fabsf(float x) { return metal::fabs(x); }
inline float sqrtf(float x) { return metal::sqrt(x); }
inline float rsqrtf(float x) { return metal::rsqrt(x); }
inline float sinf(float x) { return metal::sin(x); }
inline float cosf(float x) { return metal::cos(x); }
inline float log1pf(float x) {  // Metal has no log1p: the classic exact-quotient form
    const float u = 1.0f + x;
    return u == 1.0f ? x : metal::log(u) * (x / (u - 1.0f));
}
"""
_METAL_START = ("    const int thread_x = thread_position_in_threadgroup.x, block_x = threadgroup_position_in_grid.x,"
                " block_y = threadgroup_position_in_grid.y, block_dim = threads_per_threadgroup.x;\n")

_HEADERS = {CUDA: _CUDA_HEADER, METAL: _METAL_HEADER}
_STARTS = {CUDA: _CUDA_START, METAL: _METAL_START}
BACKENDS = tuple(_HEADERS)

# Words only one backend knows: a body must use none of them (tests/test_kernel_backends.py).
CUDA_ONLY = ("threadIdx", "blockIdx", "blockDim", "__shfl", "__sync", "__ldg", "__shared__", "make_uint4",
             "__uint_as_float", "reinterpret_cast<size_t>")
METAL_ONLY = ("thread_position_in", "threadgroup_position_in", "threads_per_threadgroup", "simd_", "threadgroup",
              "device ", "constant ", "metal::", "as_type")


def block_reduce(value: str, result: str, *, op: str = "sum") -> str:
    """Body lines that reduce each thread's float `value` over the block into `result` (declared
    here), in one fixed order: a xor butterfly in each warp, then the warps' partials in order
    0..WARPS-1, so every thread ends with the same bits, whatever the block's rows are. `op`:
    "sum" or "max". Needs `lane`, `warp`, WARPS and `STRATA_SHARED float part_s[WARPS]`; ends
    after the barrier the partials need (write part_s again only after another)."""
    step = {"sum": "{a} += {b}", "max": "{a} = fmaxf({a}, {b})"}[op]
    return f"""    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {step.format(a=value, b=f"strata_xor({value}, off)")};
    if (lane == 0) part_s[warp] = {value};
    strata_sync();
    float {result} = part_s[0];
    #pragma unroll
    for (int w = 1; w < WARPS; ++w) {step.format(a=result, b="part_s[w]")};
"""


def header(backend: str, extra: str = "") -> str:
    """What precedes the kernel function: the backend's prelude, then the kernel's own `extra`."""
    return _HEADERS[backend] + extra


def source(backend: str, body: str) -> str:
    """The kernel function's body for `backend`: the index names, then `body`."""
    return _STARTS[backend] + body
