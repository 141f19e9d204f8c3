"""Train a byte-level BPE tokenizer and write it in Hugging Face format.

The tokenizer is lossless on any text: every byte is in the base alphabet,
so ``decode(encode(text)) == text`` holds for tabs, newlines and non-ASCII.
``<|endoftext|>`` is id 0 and serves as EOS and pad; there is no BOS.

Examples:

    python -m scripts.train.build_tokenizer --out /tmp/tok --vocab-size 4096
    python -m scripts.train.build_tokenizer --out /tmp/tok --limit-mb 4 a.py b.py
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MODEL_MAX_LENGTH = 4096
# Folder names that hold tests or third-party code, never library source.
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


def stdlib_files(limit_bytes: int | None = None) -> list[Path]:
    """List the Python standard library's ``.py`` files, sorted by path.

    Test folders (``test/``, ``idlelib/idle_test``, ``lib2to3/tests``, ...)
    and site-packages are skipped.

    Args:
        limit_bytes (int, optional): Keep about this many bytes, taking every
          k-th file of the sorted list so that the whole library is sampled
          rather than its alphabetical prefix. Default: ``None`` (all files).

    Returns:
        list[Path]: The files, in sorted order.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = sorted(p.relative_to(root) for p in root.rglob("*.py"))
    files = [root / p for p in relative if not SKIP_DIRS.intersection(p.parts)]
    if limit_bytes is None:
        return files
    total = sum(p.stat().st_size for p in files)
    stride = max(1, total // limit_bytes)
    picked, size = [], 0
    for p in files[::stride]:
        if size >= limit_bytes:
            break
        picked.append(p)
        size += p.stat().st_size
    return picked


def train_tokenizer(
    files: list[Path],
    *,
    vocab_size: int,
    out_dir: Path,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> Path:
    """Train a byte-level BPE tokenizer on ``files`` and save it to ``out_dir``.

    Writes ``tokenizer.json`` and ``tokenizer_config.json``, readable by
    ``transformers.AutoTokenizer`` and ``mlx_lm.load``. Training is
    deterministic for a given file list.

    Args:
        files (list[Path]): UTF-8 text files to train on, read in this order.
        vocab_size (int): Final vocabulary size, including the 256 byte tokens
          and ``<|endoftext|>``.
        out_dir (Path): Output folder, created if missing.
        model_max_length (int): Written to ``tokenizer_config.json``.
          Default: ``4096``.

    Returns:
        Path: ``out_dir``.
    """
    if vocab_size <= 257:
        raise ValueError(f"vocab_size ({vocab_size}) must exceed 257 (256 bytes + EOS)")
    if not files:
        raise ValueError("no training files given")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    texts = (p.read_text(encoding="utf-8", errors="replace") for p in files)
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(files))
    assert tokenizer.token_to_id(EOS_TOKEN) == 0

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def check_round_trip(tokenizer_dir: Path, files: list[Path]) -> None:
    """Raise ``ValueError`` unless ``decode(encode(text)) == text`` for each file."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    samples = [p.read_text(encoding="utf-8") for p in files]
    samples.append("\tcafé ☕ naïve\r\n  日本語\n\n\x00\x7f end")
    for text in samples:
        ids = tokenizer.encode(text).ids
        decoded = tokenizer.decode(ids, skip_special_tokens=False)
        if decoded != text:
            raise ValueError(f"round trip failed on {text[:60]!r} ({len(ids)} ids)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "files", nargs="*", type=Path, help="text files (default: the stdlib)"
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument(
        "--limit-mb", type=float, default=None, help="stdlib sample size in MB"
    )
    args = parser.parse_args()
    limit = None if args.limit_mb is None else int(args.limit_mb * 1e6)
    files = args.files or stdlib_files(limit)
    train_tokenizer(files, vocab_size=args.vocab_size, out_dir=args.out)
    check_round_trip(args.out, files[:: max(1, len(files) // 5)])
    print(f"wrote {args.out} ({len(files)} files, vocab {args.vocab_size})")


if __name__ == "__main__":
    main()
