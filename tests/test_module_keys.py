"""metal_shaders/module_keys.py: strata's compiled kernels launched by a short key whose binary
MLX finds in its PTX cache directory, checked on the CPU with a stand-in for MLX's launch that
looks modules up as mlx/backend/cuda/jit_module.cpp does (`<dir>/<name>_<std::hash:x>.ptx` first,
else the source it was given, which must then be a loadable binary)."""

import mlx.core as mx
import pytest

from metal_shaders import kept, module_keys, precompiled


def test_std_hash_is_libstdcxx_std_hash():
    # std::hash<std::string>{}(s) printed by a g++ 12 / libstdc++ program on x86_64
    assert module_keys.std_hash(b"") == 0x553E93901E462A6E
    assert module_keys.std_hash(b"a") == 0x454DDEE488C1ED6B
    assert module_keys.std_hash(b"abcdefgh") == 0x783DB3E38DB898BB  # one whole word
    assert module_keys.std_hash(b"abcdefghi") == 0xB4EC9257851C8AAF  # a word and a tail
    assert module_keys.std_hash(b"strata_rows_qmatvec_v3 key 123") == 0x9F6A448709CA3D61
    assert module_keys.std_hash(bytes((i * 7 + 3) & 255 for i in range(40000))) == 0xB110ACF0AB1FFBC
    assert module_keys.module_name("k", b"abcdefgh") == "k_783db3e38db898bb"


class _Nvrtc:
    def compile(self, source, name, options, sass):
        return b"CUBIN:" + name.encode() + b":" + kept.digest({"s": source}).encode()


class _Toolchain:
    def __init__(self):
        self.nvrtc, self.options, self.sass = _Nvrtc(), ["--gpu-architecture=sm_90a"], True
        self.keys = {"build": precompiled.BUILD, "mlx": mx.__version__, "device": "NVIDIA H200"}


class _MlxLaunch:
    """MLX's precompiled launch as far as modules go: the cached file of the source's module name
    if there is one, else the source itself, which must be a binary (else the load fails)."""

    def __init__(self, directory):
        self.directory, self.launches, self.loaded = directory, [], []

    def __call__(self, **kw):
        self.launches.append(kw)
        path = self.directory / f"{module_keys.module_name(kw['name'], kw['compiled_source'])}.ptx"
        image = path.read_bytes() if path.is_file() else kw["compiled_source"]
        if not image.startswith(b"CUBIN:" + kw["name"].encode()):
            raise RuntimeError(f"Failed to load compiled {kw['name']} kernel")
        self.loaded.append(image)
        if kw["name"] == precompiled.KEY_CHECK:
            return [kw["inputs"][0] * 2 + 1]
        return [mx.zeros(kw["output_shapes"][0], kw["output_dtypes"][0])]


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """A kept directory, a PTX directory, strata's compile on, fresh keys, MLX's launch stood in."""
    monkeypatch.setattr(kept, "_directory", tmp_path / "kept")
    monkeypatch.setattr(precompiled, "_state", {"off": False, "reason": None})
    monkeypatch.setenv(module_keys.PTX_CACHE_ENV, str(tmp_path / "ptx"))
    monkeypatch.delenv(module_keys.ENV, raising=False)
    launch = _MlxLaunch(tmp_path / "ptx")
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch)
    return launch


def _kernel():
    chain = _Toolchain()
    return precompiled.PrecompiledKernel(None, name="strata_test_v1", input_names=["x"], output_names=["out"],
                                         source="    out[0] = x[0];\n", header="", ensure_row_contiguous=True,
                                         make_toolchain=lambda: chain)


def _call(kernel, dtype=mx.float32):
    return kernel(inputs=[mx.zeros((8,), dtype=dtype)], output_shapes=[(8,)], output_dtypes=[dtype],
                  grid=(32, 1, 1), threadgroup=(32, 1, 1), template=[("T", dtype)])


def _fresh_keys(monkeypatch):
    monkeypatch.setattr(module_keys, "keys", module_keys.ModuleKeys())
    monkeypatch.setattr(precompiled, "toolchain", _Toolchain)


def test_kernels_launch_by_key_once_the_check_passed(setup, monkeypatch):
    _fresh_keys(monkeypatch)
    kernel = _kernel()
    _call(kernel), _call(kernel), _call(kernel, mx.bfloat16)
    check, *calls = setup.launches
    assert check["name"] == precompiled.KEY_CHECK and module_keys.keys.verified is True
    assert [c["compiled_source"][: len(module_keys.PREFIX)] for c in calls] == [module_keys.PREFIX] * 3
    assert len(calls[0]["compiled_source"]) < 100 and calls[0]["compiled_source"] == calls[1]["compiled_source"]
    assert calls[2]["compiled_source"] != calls[0]["compiled_source"]  # another dtype, another binary
    f32, bf16 = (kernel.binary([d], [d], [("T", d)]) for d in (mx.float32, mx.bfloat16))
    assert setup.loaded[1:] == [f32, f32, bf16]  # MLX loads the very binaries, from its directory
    ptx = setup.directory / f"{module_keys.module_name('strata_test_v1', calls[0]['compiled_source'])}.ptx"
    assert ptx.read_bytes() == f32 and ptx.with_suffix(".txt").read_text() == "strata_test_v1\tstrata_test_v1\n"
    assert module_keys.keys.status() == {"active": True, "verified": True, "reason": None, "kernels": 2}
    monkeypatch.setenv(module_keys.PTX_CACHE_ENV, str(setup.directory.parent / "elsewhere"))
    _call(kernel, mx.float16)  # MLX read its directory once: the files stay where it looks
    assert setup.loaded[-1] == kernel.binary([mx.float16], [mx.float16], [("T", mx.float16)])
    assert not (setup.directory.parent / "elsewhere").exists()


def test_a_failed_check_keeps_whole_binaries(setup, monkeypatch):
    _fresh_keys(monkeypatch)
    # as if written where MLX does not look: the key's module is not found
    monkeypatch.setattr(module_keys.ModuleKeys, "file", lambda self, name, binary: module_keys.key_of(binary))
    kernel = _kernel()
    _call(kernel), _call(kernel)
    assert module_keys.keys.verified is False and "key check failed" in module_keys.keys.reason
    assert [c["compiled_source"] for c in setup.launches[1:]] == [kernel.binary([mx.float32], [mx.float32],
                                                                                [("T", mx.float32)])] * 2


@pytest.mark.parametrize("env", [{module_keys.ENV: "0"}, {module_keys.PTX_CACHE_ENV: None}])
def test_keys_off_or_no_ptx_directory_launch_whole_binaries_with_no_check(setup, monkeypatch, env):
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
    _fresh_keys(monkeypatch)
    _call(_kernel())
    (launch,) = setup.launches  # no check launched
    assert launch["compiled_source"].startswith(b"CUBIN:") and module_keys.keys.active is False
    assert not setup.directory.exists()


def test_a_kept_module_file_of_the_right_size_is_not_written_again(setup, monkeypatch):
    _fresh_keys(monkeypatch)
    keys = module_keys.keys
    key = keys.file("k", b"CUBIN:k:1")
    path = setup.directory / f"{module_keys.module_name('k', key)}.ptx"
    stamp = path.stat().st_mtime_ns
    assert module_keys.ModuleKeys().file("k", b"CUBIN:k:1") == key and path.stat().st_mtime_ns == stamp
    path.write_bytes(b"CUBIN")  # a damaged file (another size): written again
    keys.file("k", b"CUBIN:k:1")
    assert path.read_bytes() == b"CUBIN:k:1"


def test_a_launch_keeps_its_source_until_strata_builds_or_keys_are_turned_off(setup, monkeypatch):
    """Launches after the first of a dtype take the source it found (no binary or key lookup);
    turning keys or strata's build off, or an input that is no array, is seen at the next call."""
    _fresh_keys(monkeypatch)
    kernel = _kernel()
    lookups = []
    binary = kernel.binary
    monkeypatch.setattr(kernel, "binary", lambda *a: lookups.append(a) or binary(*a))
    _call(kernel), _call(kernel), _call(kernel)
    assert len(lookups) == 1 and len({c["compiled_source"] for c in setup.launches[1:]}) == 1
    assert setup.launches[-1]["compiled_source"].startswith(module_keys.PREFIX)
    module_keys.keys.disable("test: whole binaries")
    _call(kernel)
    assert setup.launches[-1]["compiled_source"] == binary([mx.float32], [mx.float32], [("T", mx.float32)])
    fallback = []
    kernel.fallback = lambda **call: fallback.append(call) or [mx.zeros((8,))]
    kernel(inputs=[1.5], output_shapes=[(8,)], output_dtypes=[mx.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))
    assert len(fallback) == 1  # a Python scalar: MLX's kernel
    launched = len(setup.launches)
    precompiled.disable("test: MLX's build")
    _call(kernel)
    assert len(fallback) == 2 and len(setup.launches) == launched
