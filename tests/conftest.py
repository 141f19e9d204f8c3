import os

import pytest


@pytest.fixture(autouse=True)
def _clean_strata_env(monkeypatch, tmp_path):
    """No STRATA_* setting from the developer's shell leaks into a test; state dirs go to tmp."""
    for name in list(os.environ):
        if name.startswith("STRATA_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "strata-home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # cost curves (calibrate.py), digests (integrity.py)


@pytest.fixture(scope="session")
def tiny_model():
    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config

    return random_model(tiny_qwen3_next_config(), seed=0)


@pytest.fixture(scope="module", params=["float32", "4-bit"])
def next_model(request):
    """A tiny random Qwen3-Next, as stored and 4-bit quantized: what the window tests run on."""
    import mlx.core as mx

    from scripts.bench.synthetic import random_model, tiny_qwen3_next_config
    from strata_cli.model.layers import stack_rows
    from strata_cli.model.quant import quantize

    model = random_model(tiny_qwen3_next_config(), seed=5)
    if request.param == "4-bit":
        quantize(model, group_size=32, bits=4)
        stack_rows(model)  # as loading does: quantizing replaced the stacked linears
        mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def emulate():
    """scripts/lab/kernel_emulate.py: the CUDA kernels' bodies compiled with g++ (CPU)."""
    from scripts.lab import kernel_emulate

    return kernel_emulate


@pytest.fixture
def failing_metal(monkeypatch):
    """Metal as the backend, its kernels stand-ins that return zeros, so a probe fails:
    `failing_metal(module, what)` gives `module` a fresh probe named `what` (as `attribute`,
    `_probe` unless given) and returns the list of the specs the kernels were made with."""
    import mlx.core as mx

    from metal_shaders import backends, probe

    made = []

    def make(**spec):
        made.append(spec)
        return lambda **kw: [mx.zeros(s, dtype=d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "metal_kernel", make)
    monkeypatch.setattr(probe, "_kernels", {})
    monkeypatch.setattr(probe, "backend", lambda: backends.METAL)

    def arm(module, what: str, attribute: str = "_probe") -> list:
        monkeypatch.setattr(module, attribute, probe.Probe(what, "MLX ops"))
        return made
    return arm
