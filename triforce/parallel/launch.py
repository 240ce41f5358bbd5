"""torchrun without its failure report (triforce.cli.launch_tp runs it).

torchrun answers a worker's exit with a Python traceback and a 30-line table, below the one line
the worker already printed. This runs the same launcher without its logging and exits with
the status of the first worker that failed; a worker killed by a signal (which printed nothing)
gets one line naming it. Workers report their own errors, one line each (triforce.cli.common.run_cli).
Ctrl-C or SIGTERM to the launcher reaches every worker (rank 0 says "interrupted"); the launcher
waits for them and exits with status 130, as they do, again without a traceback.
"""
from __future__ import annotations

import logging
import signal
import sys

INTERRUPTED = 130  # the status of an interrupted run, as triforce.cli.common.run_cli returns it


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        quiet = logging.getLogger(name)  # the agent's chatter: "Sending process closing signal" ...
        quiet.addHandler(logging.NullHandler())
        quiet.propagate = False  # torch.distributed's own handler would print it anyway
    try:
        torchrun(argv)
    except ChildFailedError as e:
        rank, first = e.get_first_failure()
        if first.exitcode >= 0:
            return first.exitcode or 1  # the worker printed its own error line
        # killed before it could say anything (the OOM killer, a signal); later failures are
        # torchrun stopping the other workers, and a peer that noticed first has already said so
        print(f"error: tensor-parallel worker {rank} was killed by {_signal_name(-first.exitcode)} (out of "
              f"memory?); the other workers were stopped", file=sys.stderr)
        return 128 - first.exitcode
    except SignalException:
        # Ctrl-C or SIGTERM to the launcher: the agent has passed it on to the workers and waited for
        # them (rank 0 said "interrupted"); exit as they do (run_cli: 130 for either), without the
        # agent's traceback
        return INTERRUPTED
    return 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before torchrun installed its handlers, so before any worker started
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
