"""`python -m triforce generate|chat|prepare|tp [flags]`: the console scripts without installing them."""
from __future__ import annotations

import importlib
import sys

from triforce.cli import prepare_process
from triforce.cli.entry import COMMANDS


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m triforce {{{'|'.join(COMMANDS)}}} [flags]  (a command's --help lists its flags)",
              file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"triforce {argv[0]}", *argv[1:]]
    prepare_process()
    importlib.import_module(COMMANDS[argv[0]]).cli()


if __name__ == "__main__":
    main()
