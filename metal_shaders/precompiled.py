"""strata's CUDA kernels compiled once per machine, not once per process.

MLX builds a kernel of `mx.fast.cuda_kernel` with NVRTC in every process that runs it (its
disk cache is off for custom kernels). Here strata compiles the same kernel itself: the source
MLX would generate (`build_kernel` of mlx/backend/cuda/custom_kernel.cpp: the header, then one
`__global__` function whose parameters are the inputs' and outputs' pointers and whose first
lines are the template values), with the options MLX gives NVRTC (`--device-as-default-execution-space`,
the GPU's own `sm_XY[a]` where NVRTC knows it, else `compute_XY[a]`, the same include
directories), keeps the cubin (or PTX) in the user cache (kept.py, keyed by MLX version, GPU,
NVRTC version, options and the whole generated source: kernel body and template values), and
launches it with `mx.fast.precompiled_cuda_kernel`.

Two differences from MLX's source, neither in the arithmetic: the function has C linkage (its
symbol is its name, which `precompiled_cuda_kernel` looks up), and in place of MLX's device
header (utils.cuh, compiled into libmlx, not on disk) only cuda_bf16.h and cuda_fp16.h are
included: no body of metal_shaders uses anything else of it (the integer types are spelled as
C++'s own). A kernel whose body reads `<input>_shape`, `_strides` or `_ndim` (MLX passes those
by value, `precompiled_cuda_kernel` cannot) stays with MLX.

NVRTC compiles one program per call and may be called from several threads at once for
different programs; ctypes releases the GIL around each call. So a start-up probe first runs dry
(`compile_ahead`: every kernel records what it would compile and returns zeros), the kernels it
names are compiled on a thread pool, and then the probe runs for real on the compiled kernels.

Any failure (no libnvrtc, a compile error, no device information) turns the path off for that
kernel, with one debug note, and the call goes to MLX's own kernel: slower to start, never a
different result. `STRATA_PRECOMPILED=0` turns it off for the process. The probes
(probe.py) run on whichever build is in use, and a probe that fails on precompiled kernels is
run again on MLX's before the family is turned off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

from . import kept, module_keys

log = logging.getLogger("strata.kernels")

ENV = "STRATA_PRECOMPILED"
BUILD = "precompiled-v1"  # bump when the generated source or options change meaning
KIND = "cubins"
PRELUDE = "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n\n"

# MLX's dtype_to_cuda_type, with the integer types spelled as C++'s own (the same types on every
# CUDA target; no header needed).
CUDA_TYPES = {
    mx.bool_: "bool", mx.int8: "signed char", mx.int16: "short", mx.int32: "int", mx.int64: "long long",
    mx.uint8: "unsigned char", mx.uint16: "unsigned short", mx.uint32: "unsigned int",
    mx.uint64: "unsigned long long", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
    mx.float64: "double",
}

THREADS_ENV = "STRATA_NVRTC_THREADS"  # most compiles at once in `compile_ahead` (1: one at a time)
_state = {"off": os.environ.get(ENV, "1") == "0", "reason": f"{ENV}=0" if os.environ.get(ENV, "1") == "0" else None}
stats = {"compiled": 0, "from_disk": 0, "mlx_calls": 0, "compile_s": 0.0, "errors": []}
_lock = threading.Lock()  # the counters and the progress line, from `compile_ahead`'s threads
# While `compile_ahead` runs dry in a thread: (kernel, input dtypes, output dtypes, template) per call
# (a thread's own: another thread's launches run as ever).
_dry = threading.local()
_dry_runs = [0]  # dry runs under way in any thread: a launch looks at its thread's only then


def active() -> bool:
    """Whether kernels go through strata's own compile (else MLX's)."""
    return not _state["off"]


def disable(reason: str) -> None:
    """Send every kernel of this process to MLX's build (a probe failed on strata's)."""
    if not _state["off"]:
        log.warning("precompiled kernels off (%s); MLX compiles strata's kernels", reason)
    _state["off"], _state["reason"] = True, reason


def status() -> dict:
    return {"active": active(), "reason": _state["reason"], **stats, "errors": list(stats["errors"]),
            "module_keys": module_keys.keys.status()}


def reads_shapes(body: str, input_names: list[str]) -> bool:
    """Whether MLX would pass `body` shapes, strides or ndims (which a precompiled kernel cannot take)."""
    return any(f"{n}{part}" in body for n in input_names for part in ("_shape", "_strides", "_ndim"))


def template_value(value) -> str:
    """A template value as MLX's build_kernel writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return CUDA_TYPES[value]


def generate_source(symbol: str, header: str, body: str, input_names: list[str], input_dtypes: list,
                    output_names: list[str], output_dtypes: list, template: list) -> str:
    """The complete CUDA source of one kernel: MLX's `build_kernel` layout (header, namespace,
    pointer parameters in order, template values first), with C linkage."""
    params = [f"    const {CUDA_TYPES[d]}* {n}" for n, d in zip(input_names, input_dtypes)]
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)]
    lines = [PRELUDE + header, "namespace mlx::core::cu {\n\n", f'extern "C" __global__ void {symbol}(\n',
             ",\n".join(params), ") {\n"]
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {template_value(value)};\n")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};\n")
        else:
            lines.append(f"  using {name} = {template_value(value)};\n")
    if template:
        lines.append("\n")
    lines += [body, "\n}\n\n} // namespace mlx::core::cu\n"]
    return "".join(lines)


# -- NVRTC -------------------------------------------------------------------------------------

class Nvrtc:
    """The NVRTC library MLX loaded (else the first one found), through ctypes."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}")

    def supports_sass(self, cc: tuple[int, int]) -> bool:
        """MLX's compiler_supports_device_sass: whether this NVRTC emits SASS for compute capability `cc`."""
        major, minor = self.version
        limit = {9: (7, 2), 10: (7, 5)}.get(major)
        if major < 9:
            return False
        if limit:
            return cc <= limit
        if major == 11 and minor == 0:
            return cc <= (8, 0)
        if major == 11 and minor < 8:
            return cc <= (8, 6)
        return True

    def compile(self, source: str, name: str, options: list[str], sass: bool) -> bytes:
        """`source` compiled to a cubin (`sass`) or PTX; raises with NVRTC's log on an error."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0,
                                                None, None), "nvrtcCreateProgram")
        try:
            args = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            result = self.lib.nvrtcCompileProgram(prog, len(options), args)
            if result != 0:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                text = ctypes.create_string_buffer(size.value + 1)
                self.lib.nvrtcGetProgramLog(prog, text)
                raise RuntimeError(f"NVRTC: {text.value.decode(errors='replace').strip()[:2000]}")
            get_size, get = (("nvrtcGetCUBINSize", "nvrtcGetCUBIN") if sass else ("nvrtcGetPTXSize", "nvrtcGetPTX"))
            size = ctypes.c_size_t()
            self._check(getattr(self.lib, get_size)(prog, ctypes.byref(size)), get_size)
            out = ctypes.create_string_buffer(size.value)
            self._check(getattr(self.lib, get)(prog, out), get)
            return out.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def nvrtc_candidates() -> list[str]:
    """Where libnvrtc may be: the one this process loaded (MLX links it), the NVIDIA wheels
    beside MLX, CUDA_HOME / CUDA_PATH, /usr/local/cuda, the loader's search path."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            found += sorted({line.split()[-1] for line in maps if "libnvrtc.so" in line and "builtins" not in line})
    except OSError:
        pass
    site = Path(mx.__file__).resolve().parents[1]
    found += sorted(glob.glob(str(site / "nvidia" / "*" / "lib" / "libnvrtc.so*")), reverse=True)
    for home in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        found += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    name = ctypes.util.find_library("nvrtc")
    if name:
        found.append(name)
    return list(dict.fromkeys(p for p in found if "builtins" not in os.path.basename(p)))


def include_args(nvrtc_major: int) -> list[str]:
    """MLX's include directories for NVRTC: its bundled headers, CCCL, the CUDA runtime's headers
    (the NVIDIA wheel beside MLX, else CUDA_HOME / CUDA_PATH / /usr/local/cuda)."""
    root = Path(mx.__file__).resolve().parent
    paths = [root / "include", root / "include" / "cccl"]
    runtime = root.parent / "nvidia" / ("cu13" if nvrtc_major >= 13 else "cuda_runtime") / "include"
    if not runtime.exists():
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        runtime = Path(home) / "include"
    paths.append(runtime)
    return [f"--include-path={p}" for p in paths if p.exists()]


class Toolchain:
    """NVRTC, the device and the options: everything a compile's key holds besides the source."""

    def __init__(self):
        errors = []
        self.nvrtc = None
        for path in nvrtc_candidates():
            try:
                self.nvrtc = Nvrtc(path)
                break
            except (OSError, AttributeError, RuntimeError) as e:
                errors.append(f"{path}: {e}")
        if self.nvrtc is None:
            raise RuntimeError("no usable libnvrtc" + (f" ({'; '.join(errors)})" if errors else ""))
        info = mx.device_info()
        self.cc = (int(info["compute_capability_major"]), int(info["compute_capability_minor"]))
        self.sass = self.nvrtc.supports_sass(self.cc)
        arch = f"{'sm' if self.sass else 'compute'}_{self.cc[0]}{self.cc[1]}{'a' if self.cc[0] >= 9 else ''}"
        self.options = ["--device-as-default-execution-space", f"--gpu-architecture={arch}",
                        *include_args(self.nvrtc.version[0])]
        self.keys = {"build": BUILD, "mlx": mx.__version__, "device": info.get("device_name", ""),
                     "compute_capability": list(self.cc), "nvrtc": list(self.nvrtc.version),
                     "options": [o for o in self.options if not o.startswith("--include-path")]}


_toolchain: list = []  # [Toolchain] once made, [exception] once it failed


def toolchain() -> Toolchain:
    if not _toolchain:
        try:
            _toolchain.append(Toolchain())
        except Exception as e:  # ctypes, a missing device key, ...: MLX's build it is
            _toolchain.append(e)
    made = _toolchain[0]
    if isinstance(made, Exception):
        raise made
    return made


def _progress(text: str) -> None:
    """One line per compile on a terminal; nothing otherwise (the first-run notice is the one line)."""
    if sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)


# -- the kernels -------------------------------------------------------------------------------

class PrecompiledKernel:
    """Called like the function `mx.fast.cuda_kernel` returns; runs strata's own compile of the
    kernel, or `fallback` (MLX's) where that is off or failed."""

    def __init__(self, fallback, *, name: str, input_names: list[str], output_names: list[str], source: str,
                 header: str, ensure_row_contiguous: bool, make_toolchain=toolchain):
        self.fallback, self.name = fallback, name
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.source, self.header, self.ensure_row_contiguous = source, header, ensure_row_contiguous
        self.make_toolchain = make_toolchain
        self.error: str | None = ("reads shapes or strides (MLX passes them by value)"
                                  if reads_shapes(source, self.input_names) else None)
        self._binaries: dict[tuple, bytes] = {}
        self._sources: dict[tuple, bytes] = {}  # launch sources by dtypes and template, for `_keys` as it was
        self._keys, self._keys_reason = None, None

    def __call__(self, **call):
        """`call`: the keywords of MLX's kernel call (inputs, output_shapes, output_dtypes, grid,
        threadgroup, template, init_value, stream), passed to MLX's kernel as given where it runs."""
        inputs = call["inputs"]
        if _dry_runs[0] and getattr(_dry, "calls", None) is not None:
            return self._note(call)
        # Every kernel outside a compiled trace launches here at every window (17 a T = 1 window
        # on the 80B shape): the source to launch with is kept per dtypes and template values once
        # a call found it (a few microseconds of Python a launch otherwise), while strata's build
        # and the keys are as they were.
        keys = module_keys.keys
        if keys is not self._keys or keys.reason is not self._keys_reason:
            self._sources, self._keys, self._keys_reason = {}, keys, keys.reason
        try:
            memo = (tuple([x.dtype for x in inputs]), tuple(call["output_dtypes"]), tuple(call.get("template") or ()))
        except AttributeError:  # an input that is no array (a Python scalar): MLX's kernel takes it
            memo = None
        source = self._sources.get(memo) if not _state["off"] else None
        if source is None:
            source = self._source(memo, inputs)
            if source is None:
                stats["mlx_calls"] += 1
                return self.fallback(**call)
        return mx.fast.precompiled_cuda_kernel(
            name=self.name, compiled_source=source, inputs=inputs, output_shapes=call["output_shapes"],
            output_dtypes=call["output_dtypes"], scalars=[], grid=call["grid"], threadgroup=call["threadgroup"],
            init_value=call.get("init_value"), ensure_row_contiguous=self.ensure_row_contiguous,
            stream=call.get("stream"))

    def _source(self, memo: tuple | None, inputs: list) -> bytes | None:
        """The source to launch with for `memo` (input dtypes, output dtypes, template values):
        the binary's key or the binary, now kept for the next call; None for MLX's build."""
        if memo is None or not active() or self.error is not None or not all(isinstance(x, mx.array) for x in inputs):
            return None
        try:
            binary = self.binary(list(memo[0]), list(memo[1]), list(memo[2]))
        except Exception as e:  # NVRTC, ctypes, the device query: any of them means MLX's build
            self.error = f"{type(e).__name__}: {e}"
            stats["errors"].append(f"{self.name}: {self.error}"[:500])
            log.debug("kernel %s: MLX compiles it (%s)", self.name, self.error)
            return None
        if module_keys.keys.verified is None:
            verify_keys()
        source = module_keys.keys.source_for(self.name, binary)  # a short key where MLX finds the binary
        if module_keys.keys is self._keys and module_keys.keys.reason is self._keys_reason:
            self._sources[memo] = source  # (a check or a write that just turned keys off: not kept)
        return source

    def _note(self, call: dict) -> list[mx.array]:
        """A dry run (`compile_ahead`): note the compile this call needs, launch nothing."""
        inputs, template = call["inputs"], tuple(call.get("template") or ())
        if active() and self.error is None and all(isinstance(x, mx.array) for x in inputs):
            _dry.calls.append((self, tuple(x.dtype for x in inputs), tuple(call["output_dtypes"]), template))
        return [mx.zeros(shape, dtype) for shape, dtype in zip(call["output_shapes"], call["output_dtypes"])]

    def binary(self, input_dtypes: list, output_dtypes: list, template: list) -> bytes:
        """The compiled kernel for these dtypes and template values: this process's, the kept
        one, or a fresh compile (then kept)."""
        memo = (tuple(input_dtypes), tuple(output_dtypes), tuple(template))
        if memo in self._binaries:
            return self._binaries[memo]
        chain = self.make_toolchain()
        source = generate_source(self.name, self.header, self.source, self.input_names, input_dtypes,
                                 self.output_names, output_dtypes, template)
        keys = {**chain.keys, "name": self.name, "source": kept.digest({"source": source})}
        found = kept.read(KIND, self.name, keys)
        if found is None:
            with kept.held(KIND, self.name, keys):  # another process compiling it: wait, then read it
                found = kept.read(KIND, self.name, keys)
                binary = self._compile(chain, source, keys) if found is None else None
        if found is not None:
            binary = found[1]
            with _lock:
                stats["from_disk"] += 1
        self._binaries[memo] = binary
        return binary

    def _compile(self, chain: Toolchain, source: str, keys: dict) -> bytes:
        start = time.perf_counter()
        binary = chain.nvrtc.compile(source, self.name, chain.options, chain.sass)
        seconds = time.perf_counter() - start
        kept.write(KIND, self.name, keys, {"seconds": seconds, "sass": chain.sass}, binary)
        with _lock:
            stats["compiled"] += 1
            stats["compile_s"] += seconds
            _progress(f"strata: compiled GPU kernel {stats['compiled']} ({self.name}, {seconds:.1f} s)")
        return binary

    def has(self, input_dtypes: tuple, output_dtypes: tuple, template: tuple) -> bool:
        """Whether this process holds the binary for these dtypes and template values already."""
        return (tuple(input_dtypes), tuple(output_dtypes), tuple(template)) in self._binaries


KEY_CHECK = "strata_module_key_check"
_KEY_CHECK_BODY = "const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 64) out[i] = x[i] * 2.0f + 1.0f;"


def verify_keys() -> bool:
    """Whether this process may launch kernels by their keys (module_keys.py): once, before the
    first kernel, one small kernel launched by its key must give its values back. Any error
    (the module not where MLX looks, a binary MLX cannot load) keeps the whole binaries."""
    keys = module_keys.keys
    if keys.verified is not None:
        return keys.verified
    keys.verified = False
    if not keys.wanted:
        return False
    kernel = PrecompiledKernel(None, name=KEY_CHECK, input_names=["x"], output_names=["out"], source=_KEY_CHECK_BODY,
                               header="", ensure_row_contiguous=True, make_toolchain=toolchain)
    try:
        binary = kernel.binary([mx.float32], [mx.float32], [])
        x = mx.arange(64, dtype=mx.float32)
        (out,) = mx.fast.precompiled_cuda_kernel(
            name=KEY_CHECK, compiled_source=keys.file(KEY_CHECK, binary), inputs=[x], output_shapes=[(64,)],
            output_dtypes=[mx.float32], scalars=[], grid=(64, 1, 1), threadgroup=(64, 1, 1))
        keys.verified = bool(mx.array_equal(out, x * 2 + 1).item())
        if not keys.verified:
            keys.disable("the key check's kernel gave other values")
    except Exception as e:  # a failed module load, a compile or a write: the whole binaries, as before
        keys.disable(f"the key check failed: {type(e).__name__}: {str(e)[:200]}")
    return keys.verified


def is_dry_run() -> bool:
    """Whether this thread is inside `compile_ahead`'s dry run (kernels return zeros)."""
    return getattr(_dry, "calls", None) is not None


def available_cores() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads() -> int:
    """Compiles `compile_ahead` runs at once: `STRATA_NVRTC_THREADS`, else the cores this process may use."""
    env = os.environ.get(THREADS_ENV, "").strip()
    return max(1, int(env)) if env.isdigit() else available_cores()


def compile_ahead(run) -> int:
    """Run `run()` dry (every precompiled kernel records the compile it needs and returns zeros;
    whatever `run` makes of zeros is dropped), then compile what it named and this process does
    not hold yet on a thread pool (kept ones are read back there too), so `run`'s real call finds
    them built. A compile that fails here is left to that real call, which then takes MLX's build.
    Returns the number of kernels built or read back; 0 when strata's compile is off or there
    is one thread."""
    if not active() or threads() <= 1 or is_dry_run():
        return 0
    _dry.calls = []
    with _lock:
        _dry_runs[0] += 1
    try:
        try:
            run()
        except Exception:  # zeros in place of outputs: a check may fail or raise, neither matters
            pass
        todo = list(dict.fromkeys(_dry.calls))
    finally:
        _dry.calls = None
        with _lock:
            _dry_runs[0] -= 1
    todo = [t for t in todo if not t[0].has(*t[1:])]
    if not todo:
        return 0
    try:
        todo[0][0].make_toolchain()  # made once, before the threads ask for it
    except Exception:
        return 0  # no toolchain: the real call takes MLX's build and says why

    def build(item) -> bool:
        kernel, input_dtypes, output_dtypes, template = item
        try:
            kernel.binary(list(input_dtypes), list(output_dtypes), list(template))
            return True
        except Exception:  # the real call compiles again, fails the same way and falls back
            return False

    with ThreadPoolExecutor(max_workers=min(threads(), len(todo)), thread_name_prefix="strata-nvrtc") as pool:
        return sum(pool.map(build, todo))
