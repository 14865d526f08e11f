"""``python -m edge_agent agent ...`` / ``python -m edge_agent profile``: the agent's commands
without the full ``fedshard`` dispatcher."""

from __future__ import annotations

import argparse
import sys

from edge_agent.cli import register


def main() -> int:
    """Parse and run one of the agent's subcommands."""
    parser = argparse.ArgumentParser(prog="python -m edge_agent")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args()
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
