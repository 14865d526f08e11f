"""``python -m fedshard``: the ``fedshard`` command without its console script."""

from fedshard.cli import main

if __name__ == "__main__":
    main()
