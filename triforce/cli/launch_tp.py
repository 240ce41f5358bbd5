"""Tensor-parallel generation and chat: torchrun starts one `triforce generate` (or `triforce chat`)
process per rank, each loading only its shard of the target (NCCL on GPUs, one per rank; gloo on CPU).

    triforce-tp --model models/qwen2.5-coder-0.5b --max-new-tokens 64     # 2 ranks
    triforce-tp chat --book book.txt --model ...   # a chat about a book: rank 0 reads the terminal
    triforce-tp --nproc 4 ...                 # degree of parallelism (or NPROC=4; default 2)
    SPEC_TP_TIMEOUT=120 triforce-tp ...       # seconds before a hung worker fails the run
    SPEC_TP_CHECK=1 triforce-tp ...           # compare logits across ranks every pass

Every other flag goes to the command (generate unless the first word is `chat`); only rank 0 prints.
The workers run with this process's interpreter, so a virtual environment need not be activated.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile


COMMANDS = ("generate", "chat")  # what a rank may run: triforce.cli.<command>


def launch_args(nproc: int, args: list[str]) -> list[str]:
    """torchrun's arguments: --standalone (a private rendezvous on a free port, so concurrent
    launches do not collide), one worker per rank running `python -m triforce.cli.generate` (or
    .chat, where args begin with `chat`)."""
    command = args[0] if args and args[0] in COMMANDS else "generate"
    rest = args[1:] if args and args[0] in COMMANDS else args
    return ["--standalone", "--nnodes=1", f"--nproc_per_node={nproc}", "--module", f"triforce.cli.{command}",
            "--tp", str(nproc), *rest]


def split_nproc(argv: list[str]) -> tuple[int, list[str]]:
    """(--nproc or $NPROC or 2, the remaining flags)."""
    nproc, rest, i = os.environ.get("NPROC", "2"), [], 0
    while i < len(argv):
        if argv[i] == "--nproc" and i + 1 < len(argv):
            nproc, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--nproc="):
            nproc = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    if not str(nproc).isdigit() or int(nproc) < 1:
        print(f"error: --nproc must be a positive number of ranks (got {nproc!r})", file=sys.stderr)
        sys.exit(2)
    return int(nproc), rest


def _signal_children(sig: int) -> None:
    """Send `sig` to each process this one started (torchrun's workers), found in /proc."""
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]  # after the name, which may hold spaces
            if parent == me:
                os.kill(int(pid), sig)
        except (OSError, IndexError):
            pass  # it ended meanwhile


def cli() -> None:
    from triforce.cli.common import SAID_ENV
    from triforce.parallel.launch import INTERRUPTED, main as torchrun

    nproc, rest = split_nproc(sys.argv[1:])
    if rest[:1] == ["chat"] and os.path.isdir("/proc"):
        # A Ctrl-C in a chat stops an answer, every rank after the same round (runtime/chat.agreed_stop).
        # torchrun's agent would stop every worker instead, and the workers, each in a session of its
        # own, never see the terminal's Ctrl-C: the agent leaves SIGINT alone (torchrun's
        # --signals-to-handle, read from PET_...; older torch reads the agent's own variable) and
        # this process passes it on to them
        os.environ["PET_SIGNALS_TO_HANDLE"] = os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGHUP,SIGQUIT"
        signal.signal(signal.SIGINT, lambda *_: _signal_children(signal.SIGINT))
    # Ranks share the machine's cores: without a limit every rank starts a thread per core and they
    # fight (on a 2-core box, 1 thread each). torchrun would otherwise force 1 and warn about it.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(cores // nproc, 1)))
    # where the workers note the error lines said, so that one every rank meets is printed once
    os.environ[SAID_ENV] = said = tempfile.mkdtemp(prefix="triforce-tp-")
    try:
        sys.exit(torchrun(launch_args(nproc, rest)))
    except KeyboardInterrupt:  # before torchrun installed its handlers, so before any worker started
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    finally:
        shutil.rmtree(said, ignore_errors=True)


if __name__ == "__main__":
    from triforce.cli import prepare_process

    prepare_process()
    cli()
