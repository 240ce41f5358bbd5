"""The console scripts (setup.py): each sets up the process, then imports its command."""
from __future__ import annotations

import importlib

from triforce.cli import prepare_process


def _entry(module: str):
    def run() -> None:
        prepare_process()  # before the command's module imports torch
        importlib.import_module(module).cli()
    run.__name__ = run.__qualname__ = module.rsplit(".", 1)[-1]
    run.__doc__ = f"Console entry point: {module}.cli after prepare_process()."
    return run


COMMANDS = {"generate": "triforce.cli.generate", "chat": "triforce.cli.chat",
            "prepare": "triforce.cli.prepare_models", "tp": "triforce.cli.launch_tp"}
generate, chat, prepare, tp = (_entry(COMMANDS[name]) for name in ("generate", "chat", "prepare", "tp"))
