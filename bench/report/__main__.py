"""``.venv/bin/python bench/report``: write bench/results/REPORT.md from the results there.

.venv/bin/python bench/report [--results DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from report.collect import write  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=BENCH / "results")
    args = parser.parse_args()
    if not args.results.is_dir():
        print(f"no results directory {args.results}", file=sys.stderr)
        return 2
    path = write(args.results, BENCH.parent)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
