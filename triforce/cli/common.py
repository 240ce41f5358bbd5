"""What the command-line front ends share: flags, model loading, prompts, progress and errors."""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

from triforce.runtime import defaults
from triforce.runtime.defaults import DEFAULT_MODEL, DEFAULT_PROMPT_FILE
NATURAL_DRAFTERS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}  # target folder -> drafter folder beside it


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=str(DEFAULT_MODEL), help="HF-format checkpoint folder (default: %(default)s)")
    g.add_argument("--draft", default=None, help="drafter folder, or 'self' for the target's own weights "
                   "with a StreamingLLM cache (default: the model's natural drafter)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto (default): bfloat16 on a GPU and on a CPU that computes it natively (avx512_bf16, "
                        "AMX), else float32")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: the cores the last minute's load leaves free, at least 1)")
    g.add_argument("--rope-scaling", default="auto",
                   help="auto (YaRN when the context exceeds trained positions), none, yarn:F or linear:F")
    g.add_argument("--context", type=int, default=None, help="keep the last N tokens of the prompt")
    g.add_argument("--offload", default="none", choices=["none", "host"],
                   help="host: keep the full KV cache in (pinned) host memory, stream it per pass")
    g.add_argument("--onchip-layers", default="0", help="with --offload host: layers whose KV stays on the device, or auto")
    g.add_argument("--offload-chunk", type=int, default=4096, help="tokens per host->device copy when streaming KV")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA graphs for every level whose cache is on the device: a small pass replays one "
                        "graph instead of launching some 30 kernels a layer (default: on with one CUDA device; "
                        "off under --tp, whose all-reduces run between kernels, and on CPU)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (launch with torchrun)")
    g.add_argument("--lower-weights", default="auto", choices=["auto", "same", "int8"],
                   help="weights the proposing levels read: same, or int8 (CPU: a weight-only int8 copy, "
                        "about half the time per draft/middle pass; the output is unchanged, verified exactly); "
                        "auto: int8 on CPU, same on a GPU")


def add_engine_args(p: argparse.ArgumentParser, adaptive: bool | None = None) -> None:
    """The generation flags; `adaptive`: the default of --adaptive, None for a tool that measures
    each mode as it is (bench, sweep), which has no such flag."""
    g = p.add_argument_group("generation")
    g.add_argument("--mode", default="triforce", choices=["autoregressive", "speculative", "retrieval", "triforce"])
    if adaptive is not None:
        g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=adaptive,
                       help="before each full-cache pass, run whichever mode made of --mode's levels (and "
                            "gamma up to --gamma2) this run's own timings and acceptance say is cheapest per "
                            "token; lossless either way, but a seed then fixes a sampled run's distribution, "
                            "not its text (default: on)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the checkpoint's generation_config.json, greedy if it has none)")
    g.add_argument("--top-p", type=float, default=None, help="(default: the checkpoint's, else 1: off)")
    g.add_argument("--top-k", type=int, default=None, help="(default: the checkpoint's, else 0: off)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--budget", type=int, default=None, help="retrieval cache tokens (default: on CPU a quarter of the context, 1,024 to 8,192; on GPU 4,096)")
    g.add_argument("--chunk-size", type=int, default=32, help="tokens per retrieval chunk (scored by their mean key)")
    g.add_argument("--gamma1", type=int, default=None, help="drafter tokens per middle pass")
    g.add_argument("--gamma2", type=int, default=None, help="middle tokens per full-cache pass")
    g.add_argument("--draft-window", type=int, default=256, help="StreamingLLM recent window of the drafter")
    g.add_argument("--sinks", type=int, default=4, help="StreamingLLM attention-sink tokens")
    g.add_argument("--rebuild-threshold", type=float, default=0.0,
                   help="rebuild the retrieval cache when middle acceptance over 4 passes drops below this")
    g.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill forward (default: 4,096 on CPU, where a whole prompt in one "
                        "causal piece prefilled at 1.0-1.8x transformers' rate against 0.45x in pieces of 512; "
                        "512 on a GPU; GenerationConfig.prefill_piece)")



@dataclass(frozen=True)
class RunConfig:
    """One run's settings, read once from the flags of add_model_args and add_engine_args. Nothing
    writes to it: a front end that needs a variant (another mode, context or number of new tokens)
    makes one with dataclasses.replace, and what is resolved later ('auto' device and lower weights)
    lives in the Session's copy."""
    # model
    model: str
    draft: str | None
    dtype: str
    device: str
    threads: int | None
    rope_scaling: str
    context: int | None
    offload: str
    onchip_layers: str
    offload_chunk: int
    cuda_graphs: bool | None  # None: on for a single CUDA device
    tp: int
    lower_weights: str
    # generation
    mode: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    budget: int | None
    chunk_size: int
    gamma1: int | None
    gamma2: int | None
    draft_window: int
    sinks: int
    rebuild_threshold: float
    prefill_chunk: int
    adaptive: bool = False


def run_config(args: argparse.Namespace, sampling: str = "greedy", **derived) -> RunConfig:
    """The run configuration of parsed flags; `derived` holds the values a front end computes
    instead of taking them as given (bench.py's --new-tokens is the number of new tokens).

    sampling: what fills --temperature / --top-p / --top-k left out: "checkpoint" (generate, chat:
    the checkpoint's generation_config.json), "model" (temperature 1: the model's own distribution)
    or "greedy" (measuring tools compare engines token for token)."""
    given = {f.name: getattr(args, f.name) for f in fields(RunConfig) if hasattr(args, f.name)}
    chosen = {"checkpoint": lambda: defaults.checkpoint_sampling(args.model), "model": lambda: {"temperature": 1.0},
              "greedy": lambda: {"temperature": 0.0}}[sampling]()
    for name, fallback in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0)):
        if given[name] is None:
            given[name] = chosen.get(name, fallback)
    return RunConfig(**{**given, **derived})


# Defaults from the sweeps in README ("Choosing the defaults"). On CPU every level reads the same
# weights, so a middle pass costs the weights plus its budget of KV and the full pass the weights plus
# the whole context: a bigger budget buys acceptance cheaply at long context (32K: 0.79 at 8,192 vs
# 0.51 at 2,048) and short middle runs (gamma2 3) beat long ones; with the target drafting for itself a
# draft pass costs a middle pass, so triforce drafts 2 at a time. Chunks of 32 tokens scored better
# than 8 (4K: middle acceptance 0.85 vs 0.80), on either device. On a GPU the full pass streams the KV
# from host memory and dwarfs the others: TriForce's published setting (budget 4,096, longer gamma2).
CPU_BUDGET_FRACTION, CPU_BUDGET_RANGE, GPU_BUDGET = 4, (1024, 8192), 4096
DEFAULT_GAMMAS = {"cpu": {"speculative": (4, 0), "retrieval": (0, 3), "triforce": (2, 3), "autoregressive": (0, 0)},
                  "cuda": {"speculative": (4, 0), "retrieval": (0, 6), "triforce": (4, 6), "autoregressive": (0, 0)}}


def default_budget(prompt_len: int, chunk: int, gpu: bool) -> int:
    if gpu:
        return GPU_BUDGET
    low, high = CPU_BUDGET_RANGE
    return min(max(prompt_len // CPU_BUDGET_FRACTION // chunk * chunk, low), high)


def generation_config(run: RunConfig, prompt_len: int, console=None):
    """GenerationConfig of a run. A default budget shrinks to fit a short prompt (said on stderr);
    a budget the user chose is checked as given."""
    from triforce.parallel import resolve_device
    from triforce.speculative import GenerationConfig
    from triforce.speculative.retrieval import MIN_CHUNKS

    gpu = resolve_device(run.device).startswith("cuda")
    g1, g2 = DEFAULT_GAMMAS["cuda" if gpu else "cpu"][run.mode]
    budget = run.budget
    if budget is None:  # a chunk size <= 0 is refused by GenerationConfig, naming it
        chunk = max(run.chunk_size, 1)
        budget = default_budget(prompt_len, chunk, gpu)
        if retrieves(run.mode) and budget >= prompt_len:
            budget = max(MIN_CHUNKS * chunk, (prompt_len // 2) // chunk * chunk)
            if console and budget < prompt_len:
                console.print(f"[yellow]note:[/] prompt has {prompt_len} tokens; retrieval budget set to {budget}")
    return GenerationConfig(
        max_new_tokens=run.max_new_tokens, temperature=run.temperature, top_p=run.top_p, top_k=run.top_k,
        seed=run.seed, budget=budget, chunk_size=run.chunk_size,
        gamma1=run.gamma1 if run.gamma1 is not None else max(g1, 1),
        gamma2=run.gamma2 if run.gamma2 is not None else max(g2, 1),
        draft_window=run.draft_window, sink_tokens=run.sinks, rebuild_threshold=run.rebuild_threshold,
        prefill_chunk=run.prefill_chunk,  # None: the device's default piece (GenerationConfig.prefill_piece)
        adaptive=run.adaptive)


def generation_plan(run: RunConfig, prompt_len: int, console=None):
    """(run, GenerationConfig) for a prompt of `prompt_len` tokens, checked before the weights load.
    A prompt too short to retrieve from (not longer than the retrieval budget a default would pick)
    runs the mode without the retrieval level, said in one line; a budget the user chose is checked
    against the prompt as given, so a mistake is named rather than worked around."""
    from triforce.speculative.retrieval import check_budget, mode_for_prompt

    cfg = generation_config(run, prompt_len, console)
    if retrieves(run.mode) and run.budget is None:
        mode, note = mode_for_prompt(run.mode, cfg.budget, cfg.chunk_size, prompt_len)
        if note:
            if console:
                console.print(f"[yellow]note:[/] {note}")
            run = replace(run, mode=mode)
            cfg = generation_config(run, prompt_len)
    if retrieves(run.mode):
        check_budget(cfg.budget, cfg.chunk_size, prompt_len)
    return run, cfg


def retrieves(mode: str) -> bool:
    """Whether the engine has a retrieval level (a budget to choose)."""
    return mode in ("retrieval", "triforce")


def resolve_draft(model: str, draft: str | None) -> str:
    if draft is not None:
        return draft
    natural = NATURAL_DRAFTERS.get(Path(model).name)
    if natural and (Path(model).parent / natural).is_dir():
        return str(Path(model).parent / natural)
    return "self"


def resolve_rope(cfg, needed: int, spec: str, console=None, new_tokens: int = 0):
    """The model config with the RoPE scaling `spec` applied for a sequence of `needed` tokens
    (model.rope.scaled_for, the rule the Python API applies too); a scaling it adds is said in one line."""
    from triforce.model.rope import scaled_for

    scaled, note = scaled_for(cfg, needed, spec, new_tokens)
    if note and console:
        console.print(f"[yellow]note:[/] {note}")
    return scaled


def context_positions(cfg, spec: str) -> int:
    """The most positions a run may use with --rope-scaling `spec`: with auto (the default) as far as
    the YaRN scaling it adds supports; with none, the checkpoint's own (its config's scaling
    included); else those of yarn:F / linear:F."""
    from triforce.model.rope import max_auto_positions

    if spec == "auto":
        return max_auto_positions(cfg)
    return cfg.max_positions if spec == "none" else resolve_rope(cfg, 0, spec).max_positions


def read_text(path: str | Path, what: str = "prompt file") -> str:
    from triforce.speculative import UserError

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist; check the path")
    data = path.read_bytes()
    if not data.strip():
        raise UserError(f"{what} {path} is empty; give it some text")
    if b"\x00" in data[:65536]:
        raise UserError(f"{what} {path} is binary, not text; give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


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
        _say_interrupted()
        _leave(130)

    handles = threading_main()  # signals can only be handled in the main thread
    if handles:
        # set, not inherited: a shell that starts a job in the background makes it ignore SIGINT
        signal.signal(signal.SIGINT, starting)
        signal.signal(signal.SIGTERM, starting)
    from triforce.speculative import UserError

    if handles:
        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, interrupt)
    debug = "--debug" in (argv if argv is not None else sys.argv)
    try:
        try:
            return main(argv)
        finally:
            state["working"] = False
    except KeyboardInterrupt:
        return _interrupted()
    except UserError as e:
        if state["signalled"]:
            return _interrupted()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MemoryError:
        print("error: out of memory; lower --context, --budget or use --dtype bfloat16", file=sys.stderr)
        return 2
    except Exception as e:  # a bug: one line unless --debug
        if state["signalled"]:
            return _interrupted()
        if debug:
            raise
        print(f"error: unexpected {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return 1


def _interrupted() -> int:
    _say_interrupted()
    if _in_process_group():
        _leave(130)
    return 130


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


__all__ = ["add_model_args", "add_engine_args", "RunConfig", "run_config", "generation_config",
           "generation_plan", "context_positions", "resolve_draft", "resolve_rope", "read_text", "run_cli",
           "replace"]
