"""scripts/bench/device_kit.sh and device_setup.sh: the GPU loan's kit. The kit's download needs
the package index (checked for syntax here); the device side runs here on stand-ins: a wheel in
three parts, another wheel and a kernel cache, put together and installed where the device's
calls will look, twice (the second time does nothing)."""

import io
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT, SETUP = ROOT / "scripts/bench/device_kit.sh", ROOT / "scripts/bench/device_setup.sh"


def wheel(path: Path, name: str) -> bytes:
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VALUE = {name!r}\n" + "# padding\n" * 2000)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path.read_bytes()


def test_the_scripts_parse():
    for script in (KIT, SETUP):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_setup_puts_the_parts_together_installs_and_writes_the_environment(tmp_path):
    keep, kit, site, ptx_root = tmp_path / "keep", tmp_path / "kit", tmp_path / "site", tmp_path / "root"
    for d in (keep, kit, ptx_root):
        d.mkdir()
    name = "bigpkg-1.0-py3-none-any.whl"
    data = wheel(tmp_path / name, "bigpkg")
    third = len(data) // 3
    (keep / "part_aa").write_bytes(data[:third])
    (keep / "part_ab").write_bytes(data[third: 2 * third])
    (kit / "part_ac").write_bytes(data[2 * third:])
    (kit / "NAME").write_text(name + "\n")
    wheel(kit / "smallpkg-1.0-py3-none-any.whl", "smallpkg")
    with tarfile.open(kit / "ptx-cache.tgz", "w:gz") as t:
        module = tarfile.TarInfo("ptx/module.ptx")
        module.size = 4
        t.addfile(module, io.BytesIO(b"PTX!"))
    env = {"PATH": os.environ["PATH"], "KEEP": str(keep), "SITE": str(site), "PTX_ROOT": str(ptx_root),
           "ENV_FILE": str(tmp_path / "env.sh"), "KIT": str(kit)}
    for _ in range(2):
        done = subprocess.run(["bash", str(SETUP)], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
        assert "kit ready: 2 packages" in done.stdout
    assert (site / "bigpkg" / "__init__.py").read_text().startswith("VALUE = 'bigpkg'")
    assert (site / "smallpkg" / "__init__.py").is_file() and (ptx_root / "ptx" / "module.ptx").read_bytes() == b"PTX!"
    lines = (tmp_path / "env.sh").read_text().splitlines()
    assert lines == [f"export PYTHONPATH={site}:{tmp_path}", f"export MLX_PTX_CACHE_DIR={ptx_root}/ptx"]
