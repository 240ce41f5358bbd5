"""What the command-line front ends share: flags (whose defaults are triforce.runtime.Settings'),
and running a front end with one-line errors and clean interrupts. Everything that turns settings
into an engine is library code in triforce.runtime."""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable

from triforce.runtime.defaults import DEFAULT_MODEL, DEFAULT_PROMPT_FILE  # noqa: F401 (the front ends' defaults)
from triforce.runtime.settings import (DEFAULTS, Settings, check_flags, context_positions, generation_config,  # noqa: F401
                                       generation_plan, make_settings, read_text, resolve_draft, resolve_rope,
                                       run_config)
from triforce.speculative.modes import MODES

RunConfig = Settings  # the measuring tools' name for it


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULTS.model, help="HF-format checkpoint folder (default: %(default)s)")
    g.add_argument("--draft", default=None, help="drafter folder, 'self' for the target's own weights "
                   "with a StreamingLLM cache, or 'lookup' for drafts looked up in the text so far (no model: "
                   "the tokens that followed the last earlier occurrence of its last 1-6 tokens) "
                   "(default: the model's natural drafter)")
    g.add_argument("--dtype", default=DEFAULTS.dtype, choices=["auto", "float32", "bfloat16"],
                   help="auto (default): bfloat16 on a GPU and on a CPU that computes it natively (avx512_bf16, "
                        "AMX), else float32")
    g.add_argument("--device", default=DEFAULTS.device, help="cpu, cuda or auto (default)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: the cores other work leaves free as the run starts, at least 1)")
    g.add_argument("--rope-scaling", default=DEFAULTS.rope_scaling,
                   help="auto (YaRN when the context exceeds trained positions), none, yarn:F or linear:F")
    g.add_argument("--context", type=int, default=None, help="keep the last N tokens of the prompt")
    g.add_argument("--offload", default=DEFAULTS.offload, choices=["none", "host"],
                   help="host: keep the full KV cache in (pinned) host memory, stream it per pass")
    g.add_argument("--onchip-layers", default=DEFAULTS.onchip_layers, help="with --offload host: layers whose KV stays on the device, or auto")
    g.add_argument("--offload-chunk", type=int, default=DEFAULTS.offload_chunk, help="tokens per host->device copy when streaming KV")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA graphs for every level whose cache is on the device: a small pass replays one "
                        "graph instead of launching some 30 kernels a layer (default: on with one CUDA device; "
                        "off under --tp, whose all-reduces run between kernels, and on CPU)")
    g.add_argument("--compile", action="store_true",
                   help="run each level's small passes (drafts, verifications) as torch.compile'd graphs over "
                        "static shapes, captured as CUDA graphs on a GPU: fewer kernels per layer, after tens "
                        "of seconds of compiling per level and pass length")
    g.add_argument("--device-rounds", action=argparse.BooleanOptionalAction, default=DEFAULTS.device_rounds,
                   help="triforce's drafter->middle rounds with no host read inside: every pass has a fixed "
                        "shape and the full pass verifies what the middle level made, capped on the device "
                        "(default: on a GPU, where each read stalls the queue; off on CPU)")
    g.add_argument("--queue-ahead", action=argparse.BooleanOptionalAction, default=DEFAULTS.queue_ahead,
                   help="plain decoding (--mode autoregressive, or the adaptive default's plain passes) queues "
                        "each full pass before the host reads the token the last one sampled, so the host's work "
                        "between passes overlaps the device's; lossless either way (default: on a GPU; off on CPU, "
                        "where a pass is done when it returns)")
    g.add_argument("--tp", type=int, default=DEFAULTS.tp, help="tensor-parallel degree (launch with torchrun)")
    g.add_argument("--weights", default=DEFAULTS.weights, choices=["auto", "stored", "dequantized"],
                   help="stored: compute with the GGUF's 4-/8-bit blocks a prepared model was made from (CPU, "
                        "bfloat16: a fifth of the bytes per step); dequantized: dense weights; auto (default): "
                        "stored where the packed kernel measures faster")
    g.add_argument("--kv-dtype", default=DEFAULTS.kv_dtype, choices=["auto", "same", "bfloat16", "float16", "float32"],
                   help="the KV cache's dtype (default auto: 16 bits for float32 compute on a CPU where that "
                        "measures faster, else the compute dtype)")
    g.add_argument("--lower-weights", default=DEFAULTS.lower_weights, choices=["auto", "same", "int8"],
                   help="weights the proposing levels read: same, or int8 (CPU: a weight-only int8 copy, "
                        "about half the time per draft/middle pass; the output is unchanged, verified exactly); "
                        "auto: int8 on CPU, same on a GPU")


def add_engine_args(p: argparse.ArgumentParser, adaptive: bool | None = None) -> None:
    """The generation flags; `adaptive`: the default of --adaptive, None for a tool that measures
    each mode as it is (bench, sweep), which has no such flag."""
    g = p.add_argument_group("generation")
    g.add_argument("--mode", default=DEFAULTS.mode, choices=MODES)
    if adaptive is None:  # a measuring tool times each mode as asked
        p.set_defaults(adaptive=False)
    else:
        g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=adaptive,
                       help="before each full-cache pass, run whichever mode made of --mode's levels (and "
                            "gamma up to --gamma2) this run's own timings and acceptance say is cheapest per "
                            "token; lossless either way, but a seed then fixes a sampled run's distribution, "
                            "not its text (default: on)")
    g.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=DEFAULTS.lookup,
                   help="adaptive runs with a model drafter also weigh drafting by lookup in its place (the tokens "
                        "that followed the text's last 1-6 tokens where they last appeared; no weights read), "
                        "run where it measures cheaper: a quotation, code, a loop (default: on, but off on a GPU "
                        "with the target drafting for itself, where retrieval beats them)")
    g.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the checkpoint's generation_config.json, greedy if it has none)")
    g.add_argument("--top-p", type=float, default=None, help="(default: the checkpoint's, else 1: off)")
    g.add_argument("--top-k", type=int, default=None, help="(default: the checkpoint's, else 0: off)")
    g.add_argument("--seed", type=int, default=DEFAULTS.seed)
    g.add_argument("--budget", type=int, default=None, help="retrieval cache tokens (default: on CPU a quarter of the context, 1,024 to 8,192; on GPU 4,096)")
    g.add_argument("--chunk-size", type=int, default=DEFAULTS.chunk_size,
                   help="tokens per retrieval chunk (ranked by the attention the newest query gives them)")
    g.add_argument("--gamma1", type=int, default=None, help="drafter tokens per middle pass")
    g.add_argument("--gamma2", type=int, default=None, help="middle tokens per full-cache pass")
    g.add_argument("--verification", default=DEFAULTS.verification, choices=["block", "token"],
                   help="how sampled drafts are verified, both exactly: block (default) judges a pass's drafts "
                        "together and accepts more of them; token is speculative sampling's one-at-a-time rule")
    g.add_argument("--draft-window", type=int, default=DEFAULTS.draft_window, help="StreamingLLM recent window of the drafter")
    g.add_argument("--sinks", type=int, default=DEFAULTS.sinks, help="StreamingLLM attention-sink tokens")
    g.add_argument("--rebuild-threshold", type=float, default=DEFAULTS.rebuild_threshold,
                   help="rebuild the retrieval cache when middle acceptance over 4 passes drops below this")
    g.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill forward (default: 4,096 on CPU, where a whole prompt in one "
                        "causal piece prefilled at 1.0-1.8x transformers' rate against 0.45x in pieces of 512; "
                        "2,048 on a GPU; GenerationConfig.prefill_piece)")




def run_cli(main: Callable[[list[str] | None], int], argv=None) -> int:
    """Run a front end: user errors become one line on stderr, Ctrl-C or SIGTERM a clean exit (130).

    A signal is an interruption even when it first shows up as something else: under tensor
    parallelism every worker gets it, and one that is waiting in a collective sees its peer leave
    before its own handler runs (a `UserError` naming the peer). Such a run still ends as
    "interrupted", said once (by rank 0), and a worker in a process group leaves without tearing
    the group down: with its peers gone, gloo's or NCCL's teardown can abort in C++ ("terminate
    called without an active exception")."""
    import signal

    state = {"working": True, "signalled": False}

    def interrupt(signum, frame):
        state["signalled"] = True
        if signum == signal.SIGINT and state["working"]:
            raise KeyboardInterrupt  # as Python's own handler: every Ctrl-C (chat stops an answer with one)
        if signum != signal.SIGINT:  # SIGTERM interrupts the work once; after that it just exits
            if state["working"]:
                state["working"] = False
                raise KeyboardInterrupt
            _leave(128 + signum)

    def starting(signum, frame):
        # torch takes seconds to import, and a KeyboardInterrupt raised inside an import can leave it
        # half loaded (numpy then refuses to load "more than once", with a traceback): nothing has
        # started yet, so a signal meanwhile just ends the process
        _interrupted_now()

    def swallowed(unraisable):
        # the handler's KeyboardInterrupt raised inside a finalizer (a __del__, a weakref callback),
        # which Python cannot propagate: it prints "Exception ignored in: ..." with the traceback and
        # the work goes on (CI saw a tensor-parallel worker do it after rank 0's "interrupted"). The
        # run was interrupted: end it so, here (what a KeyboardInterrupt would unwind is skipped; a
        # book's prefill keeps its last checkpoint)
        if state["signalled"] and isinstance(unraisable.exc_value, KeyboardInterrupt):
            _interrupted_now()
        previous_hook(unraisable)

    handles = threading_main()  # signals can only be handled in the main thread
    previous_hook = sys.unraisablehook
    if handles:
        sys.unraisablehook = swallowed
        # set, not inherited: a shell that starts a job in the background makes it ignore SIGINT
        signal.signal(signal.SIGINT, starting)
        signal.signal(signal.SIGTERM, starting)
    from triforce.runtime.memory import reuse_freed_memory
    from triforce.speculative import UserError

    reuse_freed_memory()  # as the commands run: benchmarks time the engine as a user runs it
    if handles:
        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, interrupt)
    debug = "--debug" in (argv if argv is not None else sys.argv)
    try:
        try:
            return main(argv)
        finally:
            state["working"] = False
            sys.unraisablehook = previous_hook  # in-process callers (tests) get theirs back
    except KeyboardInterrupt:
        return _interrupted()
    except UserError as e:
        if state["signalled"]:
            return _interrupted()
        say_error(f"error: {as_flags(str(e))}", consequence=getattr(e, "consequence", False))
        return 2
    except MemoryError:
        say_error("error: out of memory; lower --context, --budget or use --dtype bfloat16")
        return 2
    except Exception as e:  # a bug: one line unless --debug
        if state["signalled"]:
            return _interrupted()
        if debug:
            raise
        say_error(f"error: unexpected {type(e).__name__}: {e} (run with --debug for the traceback)")
        return 1


# set by triforce-tp (cli/launch_tp.py) for its workers: a folder where each error line said is a file
SAID_ENV = "TRIFORCE_TP_SAID"


def say_error(line: str, consequence: bool = False) -> None:
    """Print an error line, once between the tensor-parallel workers of one launch: most errors (a
    setting, the model, the prompt) strike every rank alike, and a user reads the line once. A line
    only one worker meets (its memory, its peers) is still said by that worker. A `consequence` (its
    peers stopped: errors.PeerStopped) is said only where no worker has said a line: one that meets
    an error first says it before it exits, and the others then lose it."""
    said = os.environ.get(SAID_ENV)
    if said and consequence:
        try:
            if os.listdir(said):
                return
        except OSError:
            pass
    if said:
        name = hashlib.sha1(line.encode()).hexdigest()
        try:
            os.close(os.open(os.path.join(said, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # another worker said it
        except OSError:
            pass  # the folder is gone: say it anyway
    print(line, file=sys.stderr)


def _interrupted() -> int:
    _say_interrupted()
    if _in_process_group():
        _leave(130)
    return 130


def _interrupted_now() -> None:
    _say_interrupted()
    _leave(130)


def _in_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _say_interrupted() -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun every worker is stopped: say it once
        print("interrupted", file=sys.stderr)


def _leave(code: int) -> None:
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start


# the engine's and the runtime's errors name settings (GenerationConfig.budget, Settings.context);
# the command line says the flag that sets each
FLAG_OF = {"sink_tokens": "sinks"}


def as_flags(message: str) -> str:
    """A library error in command-line words: 'GenerationConfig.max_new_tokens' -> '--max-new-tokens',
    'ChatOptions.room' -> '--room'."""
    def flag(m: re.Match) -> str:
        return "--" + FLAG_OF.get(m.group(2), m.group(2)).replace("_", "-")
    return re.sub(r"\b(GenerationConfig|Settings|ChatOptions)\.(\w+)", flag, message)


LOADING_LOG_SECONDS = 30.0  # away from a terminal, a line of loading progress at most this often


@contextmanager
def loading_status(console, what: str):
    """While a session loads: at a terminal a spinner whose text the session updates (compiling the
    CPU kernels on a first run, then loading the weights); elsewhere (a log, a pipe) the first update
    and one every LOADING_LOG_SECONDS, so a first run's minute of compiling is said, not silent."""
    if console.is_terminal:
        with console.status(what) as status:
            def update(text: str) -> None:  # the end of compiling stays on screen; the rest replace one another
                console.print(text, highlight=False) if text.startswith("compiled ") else status.update(text)

            yield update
        return
    said = [0.0]

    def update(text: str) -> None:
        now = time.monotonic()
        if not said[0] or now - said[0] >= LOADING_LOG_SECONDS or text.startswith("compiled"):
            console.print(text, highlight=False)
            said[0] = now

    yield update


def open_session(run: Settings, text: str | None, modes=MODES, tokenizer=None, load: bool = True):
    """A Session whose notes and loading spinner go to a rich console on stderr (quiet on ranks other
    than 0), loaded for `modes` unless `load` is False."""
    from triforce.runtime.session import Session

    class ConsoleSession(Session):
        def __init__(self):
            from rich.console import Console
            from rich.markup import escape

            self.console = Console(stderr=True)
            super().__init__(run, text, tokenizer, say=lambda note: self.console.print(f"[yellow]note:[/] {escape(as_flags(note))}"),
                             loading=lambda what: loading_status(self.console, what))
            self.console.quiet = not self.is_main

    session = ConsoleSession()
    return session.load(modes) if load else session
