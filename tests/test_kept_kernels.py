"""What strata keeps across processes for its GPU kernels (issue 41), checked on the CPU with
stand-ins for NVRTC and the device: probe verdicts (probe.Probe, kept.py) kept per MLX version,
device, build, kernel sources and dtype, and strata's own compiled kernels
(precompiled.py) kept per toolchain and generated source, with MLX's build wherever that fails."""

import mlx.core as mx
import pytest

from metal_shaders import backends, kept, module_keys, precompiled, probe


@pytest.fixture
def keep(tmp_path, monkeypatch):
    """A kept directory of its own, strata's compile on, fresh counters, whole binaries launched
    (tests/test_module_keys.py launches by key)."""
    monkeypatch.setattr(kept, "_directory", tmp_path)
    monkeypatch.delenv(module_keys.PTX_CACHE_ENV, raising=False)
    monkeypatch.setattr(module_keys, "keys", module_keys.ModuleKeys())
    monkeypatch.setattr(precompiled, "_state", {"off": False, "reason": None})
    monkeypatch.setattr(precompiled, "stats", {"compiled": 0, "from_disk": 0, "mlx_calls": 0, "compile_s": 0.0,
                                               "errors": []})
    return tmp_path


def test_a_kept_file_is_read_back_only_for_its_own_keys(keep):
    keys = {"mlx": "0.32.4", "device": "NVIDIA H200", "dtype": "bfloat16"}
    assert kept.read("k", "name", keys) is None
    assert kept.write("k", "name", keys, {"seconds": 1.5}, b"\x7fELF-binary")
    record, payload = kept.read("k", "name", keys)
    assert payload == b"\x7fELF-binary" and record["seconds"] == 1.5
    for changed in ({**keys, "mlx": "0.32.5"}, {**keys, "device": "NVIDIA A100"}, {**keys, "dtype": "float32"}):
        assert kept.read("k", "name", changed) is None
    (bin_file,) = keep.glob("k/*.bin")
    bin_file.write_bytes(b"\x7fELF-binarz")  # damaged on disk: a miss, never loaded
    assert kept.read("k", "name", keys) is None
    kept.configure(None)
    assert kept.read("k", "name", keys) is None and not kept.write("k", "name", keys, {})


def _counting_check(calls, error=None):
    def check(dtypes):
        if precompiled.is_dry_run():  # compile_ahead's dry run: not a probe
            return "dry"
        calls.append(dtypes)
        return error(len(calls)) if callable(error) else error
    return check


def test_a_passing_verdict_is_kept_per_dtype_and_invalidated_by_every_key(keep, monkeypatch):
    monkeypatch.setattr(probe, "backend", lambda: backends.CUDA)
    calls = []
    check = _counting_check(calls)
    assert probe.Probe("fam", "fallback").usable(check, mx.bfloat16) is True
    assert calls == [(mx.bfloat16,)]  # only the model's dtype is probed
    later = probe.Probe("fam", "fallback")  # the next process
    assert later.usable(check, mx.bfloat16) is True and len(calls) == 1 and later.kept_hits == 1
    assert later.usable(check, mx.float32) is True and calls[-1] == (mx.float32,)  # another dtype: probed
    n = len(calls)
    changes = [
        lambda: monkeypatch.setattr(mx, "__version__", "9.9.9"),
        lambda: monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "NVIDIA A100"}),
        lambda: monkeypatch.setattr(probe, "sources_digest", lambda: "another kernel source"),
        lambda: precompiled.disable("test: MLX's build"),
    ]
    for change in changes:
        change()
        assert probe.Probe("fam", "fallback").usable(check, mx.bfloat16) is True
        assert len(calls) == n + 1, "a changed key must probe again"
        n += 1
    assert probe.Probe("other family", "fallback").usable(check, mx.bfloat16) and len(calls) == n + 1


def test_a_decided_probe_answers_without_asking_again_even_inside_a_dry_run(keep, monkeypatch):
    """Once its verdicts are in, `usable` answers from what it said (every projection of every step
    asks); a probe that failed says so inside another probe's dry run too, where an undecided one
    follows the kernel path."""
    monkeypatch.setattr(probe, "backend", lambda: backends.CUDA)
    calls = []
    failing = probe.Probe("fam", "fallback")
    assert failing.usable(_counting_check(calls, "mismatch"), mx.bfloat16) is False
    n = len(calls)  # strata's build, then MLX's
    assert failing.usable(_counting_check(calls), mx.bfloat16) is False and len(calls) == n
    monkeypatch.setattr(precompiled, "is_dry_run", lambda: True)
    assert failing.usable(_counting_check(calls), mx.bfloat16) is False
    assert probe.Probe("undecided", "fallback").usable(_counting_check(calls), mx.bfloat16) is True and len(calls) == n


def test_a_failure_is_not_kept_and_a_failure_on_strata_builds_is_retried_on_mlx(keep, monkeypatch):
    monkeypatch.setattr(probe, "backend", lambda: backends.CUDA)
    calls = []
    failing = _counting_check(calls, "rows differ")
    first = probe.Probe("fam", "fallback")
    assert first.usable(failing, mx.float32) is False and first.status()["error"] == "rows differ"
    assert len(calls) == 2 and not precompiled.active()  # retried once on MLX's build, then off
    precompiled._state.update(off=False, reason=None)
    assert probe.Probe("fam", "fallback").usable(failing, mx.float32) is False and len(calls) == 4
    # fails on strata's build only: passes on MLX's, and that pass is kept under MLX's build
    precompiled._state.update(off=False, reason=None)
    only_first = _counting_check(calls, lambda n: "mismatch" if n == 5 else None)
    assert probe.Probe("fam", "fallback").usable(only_first, mx.float32) is True
    assert len(calls) == 6 and not precompiled.active()
    assert probe.Probe("fam", "fallback").usable(only_first, mx.float32) is True and len(calls) == 6


def test_off_a_gpu_nothing_is_probed_or_kept(keep):
    calls = []
    assert probe.Probe("fam", "fallback").usable(_counting_check(calls)) is False
    assert calls == [] and not any(keep.iterdir())


# -- strata's own compile of the CUDA kernels --------------------------------------------------

class _Nvrtc:
    def __init__(self):
        self.compiled = []

    def compile(self, source, name, options, sass):
        self.compiled.append(source)
        return b"CUBIN:" + kept.digest({"s": source}).encode()


class _Toolchain:
    def __init__(self, device="NVIDIA H200"):
        self.nvrtc, self.options, self.sass = _Nvrtc(), ["--gpu-architecture=sm_90a"], True
        self.keys = {"build": precompiled.BUILD, "mlx": mx.__version__, "device": device}


BODY = "    const int i = threadIdx.x;\n    out[i] = static_cast<T>(ROWS) * x[i];\n"


def _kernel(chain, launches, fallback_calls, body=BODY):
    def fallback(**call):
        fallback_calls.append(call)
        return ["mlx"]
    return precompiled.PrecompiledKernel(fallback, name="strata_test_v1", input_names=["dims", "x"],
                                         output_names=["out"], source=body, header="#define H 1\n",
                                         ensure_row_contiguous=True, make_toolchain=lambda: chain)


def _call(kernel, rows=4, dtype=mx.float32):
    return kernel(inputs=[mx.array([1], dtype=mx.int32), mx.zeros((8,), dtype=dtype)], output_shapes=[(8,)],
                  output_dtypes=[dtype], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                  template=[("T", dtype), ("ROWS", rows), ("FLAG", True)])


@pytest.fixture
def launches(monkeypatch):
    made = []
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", lambda **kw: made.append(kw) or ["precompiled"])
    return made


def test_generated_source_follows_mlx_build_kernel():
    source = precompiled.generate_source("k", "#define H 1\n", BODY, ["dims", "x"], [mx.int32, mx.bfloat16], ["out"],
                                         [mx.bfloat16], [("T", mx.bfloat16), ("ROWS", 4), ("FLAG", True)])
    assert source.startswith(precompiled.PRELUDE + "#define H 1\nnamespace mlx::core::cu {")
    assert ('extern "C" __global__ void k(\n    const int* dims,\n    const __nv_bfloat16* x,\n'
            '    __nv_bfloat16* out) {\n  using T = __nv_bfloat16;\n  constexpr int ROWS = 4;\n'
            '  constexpr bool FLAG = true;\n\n' + BODY + "\n}\n\n} // namespace mlx::core::cu\n") in source


def test_a_compiled_kernel_is_kept_per_source_and_toolchain(keep, launches):
    chain, mlx_calls = _Toolchain(), []
    assert _call(_kernel(chain, launches, mlx_calls)) == ["precompiled"]
    (launch,) = launches
    assert launch["name"] == "strata_test_v1" and launch["compiled_source"].startswith(b"CUBIN:")
    assert launch["ensure_row_contiguous"] is True and launch["scalars"] == [] and launch["grid"] == (32, 1, 1)
    assert len(chain.nvrtc.compiled) == 1 and "constexpr int ROWS = 4;" in chain.nvrtc.compiled[0]
    again = _kernel(chain, launches, mlx_calls)  # the next process: read back, not compiled
    _call(again), _call(again)
    assert len(chain.nvrtc.compiled) == 1 and precompiled.stats["from_disk"] == 1
    assert launches[-1]["compiled_source"] == launch["compiled_source"]
    _call(again, rows=8)  # another template value: its own compile
    _call(again, dtype=mx.bfloat16)  # another dtype: its own compile
    assert len(chain.nvrtc.compiled) == 3
    other_gpu = _Toolchain(device="NVIDIA A100")
    _call(_kernel(other_gpu, launches, mlx_calls))
    assert len(other_gpu.nvrtc.compiled) == 1 and mlx_calls == []


def test_any_failure_falls_back_to_mlx_build(keep, launches, monkeypatch):
    def broken():
        raise RuntimeError("no usable libnvrtc")
    mlx_calls = []
    kernel = _kernel(None, launches, mlx_calls)
    kernel.make_toolchain = broken
    assert _call(kernel) == ["mlx"] and _call(kernel) == ["mlx"] and launches == []
    assert "no usable libnvrtc" in kernel.error and len(precompiled.stats["errors"]) == 1
    assert mlx_calls[0]["template"][1] == ("ROWS", 4)  # MLX gets the call as it was made
    strided = _kernel(_Toolchain(), launches, mlx_calls, body=BODY + "    (void)x_strides[0];\n")
    assert _call(strided) == ["mlx"] and launches == []  # MLX passes strides by value: its build
    precompiled.disable("test")
    chain = _Toolchain()
    assert _call(_kernel(chain, launches, mlx_calls)) == ["mlx"] and chain.nvrtc.compiled == []


def test_sass_support_follows_mlx():
    nvrtc = object.__new__(precompiled.Nvrtc)
    for version, cc, sass in (((13, 0), (9, 0), True), ((11, 0), (8, 6), False), ((11, 8), (9, 0), True),
                              ((10, 2), (7, 5), True), ((10, 2), (8, 0), False)):
        nvrtc.version = version
        assert nvrtc.supports_sass(cc) is sass


class _SlowNvrtc(_Nvrtc):
    """Takes a while per compile and notes how many ran at once."""

    def __init__(self):
        import threading

        super().__init__()
        self.running = self.peak = 0
        self.lock = threading.Lock()

    def compile(self, source, name, options, sass):
        import time

        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(0.2)
        with self.lock:
            self.running -= 1
        return super().compile(source, name, options, sass)


def test_a_probes_kernels_compile_at_once_on_threads_before_it_runs(keep, launches, monkeypatch):
    monkeypatch.setenv(precompiled.THREADS_ENV, "4")
    chain, mlx_calls = _Toolchain(), []
    chain.nvrtc = _SlowNvrtc()
    kernel = _kernel(chain, launches, mlx_calls)
    seen = []

    def check(dtypes):
        outs = [_call(kernel, rows=rows, dtype=dtypes[0]) for rows in (1, 2, 4, 8)]
        seen.append(outs)
        return None if all(o == ["precompiled"] for o in outs) else "mismatch"

    assert precompiled.compile_ahead(lambda: check((mx.float32,))) == 4
    assert launches == [] and mlx_calls == []  # the dry run launched nothing
    assert [o[0].tolist() for o in seen[0]] == [[0.0] * 8] * 4 and not precompiled.is_dry_run()  # it saw zeros
    assert len(chain.nvrtc.compiled) == 4 and chain.nvrtc.peak > 1 and precompiled.stats["compiled"] == 4
    assert check((mx.float32,)) is None and len(launches) == 4 and len(chain.nvrtc.compiled) == 4
    assert precompiled.compile_ahead(lambda: check((mx.float32,))) == 0  # held already: nothing to do
    nested = probe.Probe("nested", "fallback")  # a probe asked inside a dry run decides nothing
    monkeypatch.setattr(probe, "backend", lambda: backends.CUDA)
    assert precompiled.compile_ahead(lambda: nested.usable(lambda dtypes: "zeros", mx.float32)) == 0
    assert nested.verdicts == {} and precompiled.active()
    monkeypatch.setenv(precompiled.THREADS_ENV, "1")
    assert precompiled.compile_ahead(lambda: check((mx.bfloat16,))) == 0 and len(chain.nvrtc.compiled) == 4


def test_one_kernel_made_at_once_in_two_places_compiles_once(keep, launches):
    """Two makers of the same kernel at once (two processes of the kernel warm-up, here two
    threads with kernels of their own): one compiles under the file's lock, the other waits
    and reads it back."""
    from concurrent.futures import ThreadPoolExecutor

    chain = _Toolchain()
    chain.nvrtc = _SlowNvrtc()
    kernels = [_kernel(chain, launches, []) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        binaries = list(pool.map(lambda k: k.binary([mx.int32, mx.float32], [mx.float32], [("ROWS", 4)]), kernels))
    assert binaries[0] == binaries[1] and len(chain.nvrtc.compiled) == 1 and chain.nvrtc.peak == 1
    assert precompiled.stats["compiled"] == 1 and precompiled.stats["from_disk"] == 1
