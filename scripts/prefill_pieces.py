"""Where one prompt chunk's time goes, piece by piece: see strata_cli/bench/prefill_pieces.py.

    python scripts/prefill_pieces.py                       # demo model, 512 rows at offset 2,048 (CPU)
"""

from strata_cli.bench.prefill_pieces import main

if __name__ == "__main__":
    main()
