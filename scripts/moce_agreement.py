"""Cache-aware routing (MoCE) against exact routing: see strata_cli/bench/moce_agreement.py.

    python scripts/moce_agreement.py --tokens 48 --repeats 3
"""

from strata_cli.bench.moce_agreement import main

if __name__ == "__main__":
    main()
