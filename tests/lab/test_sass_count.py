"""scripts/lab/kernel_emulate.py's sass_instructions: a cubin's one kernel's machine instructions,
read from its ELF section table (nvcc is not on the test machine: the ELF is built here)."""

import struct

import pytest

from scripts.lab.kernel_emulate import sass_instructions


def elf(sections: dict[str, int]) -> bytes:
    """A 64-bit little-endian ELF holding only a section table: a null section, the names'
    table, then one section of `size` bytes per name."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n in sections)
    header_size, entry = 64, 64
    shoff = header_size + len(names)
    table = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
             struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, header_size, len(names), 0, 0, 1, 0)]
    offset = len(b"\0.shstrtab\0")
    for name, size in sections.items():
        table.append(struct.pack("<IIQQQQIIQQ", offset, 1, 0, 0, 0, size, 0, 0, 16, 0))
        offset += len(name) + 1
    head = bytearray(header_size)
    head[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HHH", head, 0x3A, entry, len(table), 1)
    return bytes(head) + names + b"".join(table)


def test_the_one_kernels_text_in_instructions(tmp_path):
    path = tmp_path / "k.cubin"
    path.write_bytes(elf({".nv.info": 40, ".text.custom_kernel_x": 16 * 3144, ".nv.constant0.custom_kernel_x": 900}))
    assert sass_instructions(path) == 3144
    path.write_bytes(elf({".text.a": 32, ".text.b": 64}))
    with pytest.raises(ValueError, match="2 kernels' code"):
        sass_instructions(path)
    path.write_bytes(b"\x7fELF\x01" + bytes(80))
    with pytest.raises(ValueError, match="not a 64-bit ELF"):
        sass_instructions(path)
