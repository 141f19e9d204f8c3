"""Seconds from starting `strata generate` to its first byte of output on a long prompt, as a new
user meets it (process start, model load, prefill, first token), with the CPU prompt path in
numpy's BLAS and in MLX's (STRATA_PROMPT_BLAS), alternating; medians.

The prompt is the stdlib's json/decoder.py and json/encoder.py cut to `--tokens` demo-model
tokens (issue 11 measured 12.3 s for a 3,014-token prompt before the chunked prefill).

    python -m scripts.lab.generate_ttft             # 3,014 tokens, 3 rounds
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "strata_cli" / "assets" / "demo"


def first_byte_seconds(prompt: str, env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "strata_cli.cli", "generate", "-", "--max-tokens", "16"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, **env})
    proc.stdin.write(prompt.encode())
    proc.stdin.close()
    proc.stdout.read(1)
    seconds = time.perf_counter() - start
    proc.wait()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=3014)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    source = Path(json.__file__).parent
    text = (source / "decoder.py").read_text() + (source / "encoder.py").read_text()
    tokenizer = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    prompt = tokenizer.decode(tokenizer.encode(text).ids[: args.tokens])
    seconds = {"numpy": [], "mlx": []}
    for _ in range(args.rounds):
        for mode in seconds:
            seconds[mode].append(first_byte_seconds(prompt, {"STRATA_PROMPT_BLAS": mode}))
    print(f"prompt of {len(tokenizer.encode(prompt).ids)} tokens")
    for mode, runs in seconds.items():
        print(f"prompt BLAS {mode}: first byte after {statistics.median(runs):.2f} s "
              f"(median of {args.rounds}: {', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
