"""``python -m devtools.lab up|down|exec|status``: the lab's commands without the dispatcher."""

from __future__ import annotations

import argparse
import sys

from devtools.lab.cli import register


def main() -> int:
    """Parse and run one ``lab`` subcommand."""
    parser = argparse.ArgumentParser(prog="python -m devtools.lab")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(["lab", *sys.argv[1:]])
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
