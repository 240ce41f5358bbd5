"""A generation session: settings in, a loaded and configured engine out (device, dtype, threads,
tensor parallelism, int8 proposers, RoPE for the run's length, memory checks, offload, CUDA graphs,
per-device defaults, drafter pairing). The command line, the Python API and the measuring tools
all open their engines here, so the same settings give the same engine.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable, ContextManager

import torch

from triforce.model.config import ModelConfig
from triforce.model.gguf_loader import weights_summary
from triforce.model.kv_dtype import resolve_kv_dtype, use_kv_dtype
from triforce.model.errors import UserError
from triforce.model.loader import load_tokenizer
from triforce.model.quant import resolve_lower_weights, with_lower_weights
from triforce.model.tensor_parallel import check_shardable
from triforce.parallel import resolve_device, setup_tensor_parallel
from triforce.speculative import Generator
from triforce.speculative.modes import MODES, drafts

from .defaults import auto_dtype, auto_threads
from .memory import reuse_freed_memory
from .loading import load, resolve_dtype
from .report import versus_plain
from .settings import (Settings, check_flags, context_positions, generation_plan, onchip_layers, resolve_draft,
                       resolve_rope)

log = logging.getLogger("triforce")


def _log_note(note: str) -> None:
    log.warning(note)


HOST_MEMORY_ENV = "SPEC_HOST_MEMORY_BYTES"  # pretend this much host memory is available (for tests)


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or SPEC_HOST_MEMORY_BYTES when set: the tests use it to
    exercise the refusal deterministically, on any machine."""
    override = os.environ.get(HOST_MEMORY_ENV)
    if override is not None:
        try:
            return int(override)
        except ValueError:
            raise UserError(f"{HOST_MEMORY_ENV}={override!r} is not a number of bytes; unset it") from None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Session:
    """Construction checks everything that is cheap to check (flags, model config, tokenizer, prompt,
    positions, host memory), so a mistake is refused before `load` reads any weights.

    `run` is the run configuration as given; `self.run` is the same with its device and lower
    weights resolved ('auto' made concrete), which is what everything after reads."""

    def __init__(self, run: Settings, text: str | None, tokenizer=None, say: Callable[[str], None] | None = None,
                 loading: Callable[[str], ContextManager] | None = None):
        """`say(note)`: where one-line notes go (a setting adjusted to the prompt, RoPE scaling added;
        default: the `triforce` logger, as warnings); `loading(what)`: a context manager entered while
        the CPU kernels build and the weights load (the command line's spinner), whose value, when
        not None, is called with a line of progress (the kernels' compiling on a first run)."""
        self.say = say or _log_note
        self._loading = loading
        check_flags(run)
        self.threads_why = _set_threads(run.threads)
        reuse_freed_memory()  # a prefill's large intermediates, reused instead of faulted in every layer
        self.dist = _setup_parallel(run)
        self.is_main = self.dist is None or self.dist.rank == 0
        self.stdout = sys.stdout if self.is_main else open(os.devnull, "w")
        self.device = self.dist.device if self.dist else resolve_device(run.device)
        self.asked_dtype = run.dtype
        dtype = auto_dtype(self.device) if run.dtype == "auto" else run.dtype
        self.dtype = resolve_dtype(dtype)
        lower = resolve_lower_weights(run.lower_weights, self.device, self.dtype)
        if lower != "same" and self.device != "cpu":
            raise UserError(f"Settings.lower_weights {lower} is for the CPU path (torch's fused int8 kernel "
                            "is CPU-only); use Settings.lower_weights same on a GPU")
        self.run = replace(run, device=self.device, lower_weights=lower, dtype=dtype, threads=torch.get_num_threads())
        self.draft = resolve_draft(run.model, run.draft)
        base_cfg = ModelConfig.from_folder(run.model)
        check_shardable(base_cfg, self.dist.world_size if self.dist else 1)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(run.model)  # chat read the book with it
        self.prompt_ids = self.encode(text) if text is not None else []  # text, or token ids
        needed = len(self.prompt_ids) + run.max_new_tokens
        if run.context:  # a --context that can never fit is refused even when this prompt is shorter
            limit = context_positions(base_cfg, run.rope_scaling)
            if run.context + run.max_new_tokens > limit:
                raise UserError(f"Settings.context {run.context} plus {run.max_new_tokens} new tokens exceeds the {limit} "
                                f"positions this model supports; use Settings.context {limit - run.max_new_tokens} or less")
        self.config = resolve_rope(base_cfg, needed, run.rope_scaling, self.say if self.is_main else None, run.max_new_tokens)
        self._check_host_memory(needed)
        self.needed = needed

    def load(self, modes=MODES) -> "Session":
        """Load the models; `modes`: those this session will run (their proposing levels alone get
        cheaper weights)."""
        run = self.run
        what = f"loading {run.model}" + ("" if self.draft in ("self", "lookup") else f" and {self.draft}")
        with self._loading(what) if self._loading else nullcontext() as update:
            if self._build_kernels(update) and update is not None:  # the spinner says what comes next
                update(what)
            self.loaded = load(run.model, self.draft, self.dtype, self.device, target_config=self.config,
                               max_len=self.needed, rank=self.dist.rank if self.dist else 0,
                               world_size=self.dist.world_size if self.dist else 1, tokenizer=self.tokenizer,
                               weights=run.weights)
        if self.dist:
            self.dist.attach(self.loaded.models.target)
        # the int8 twin shares the attention and MLP modules' hooks (tensor parallelism) by reference
        target, drafter = self.loaded.models.proposers(modes)
        exact = self.loaded.models
        self.loaded.models = models = with_lower_weights(exact, run.lower_weights, target, drafter)
        if models.proposing_target is None and models.drafter is exact.drafter:
            # no cheaper copy was made (weights as stored already read fewer bytes): say what runs
            self.run = run = replace(run, lower_weights="same")
        self.kv_dtype = resolve_kv_dtype(run.kv_dtype, self.device, self.dtype)
        for model in (models.target, models.drafter, models.proposing_target):
            if model is not None and model is not models.lookup:
                use_kv_dtype(model, self.kv_dtype)
        self.weights = weights_summary(models.target)
        return self

    def _build_kernels(self, report: Callable[[str], None] | None) -> int:
        """On CPU, compile the kernels this run will use that this machine has not built, with
        progress, before the weights load (model/kernel_builds.py). Returns how many compiled."""
        if torch.device(self.device).type != "cpu":
            return 0
        from triforce.model.gguf_loader import gguf_origin
        from triforce.model.kernel_builds import build

        model = Path(self.run.model)
        stored = self.run.weights != "dequantized" and (model.is_file() or gguf_origin(model) is not None)
        if report is None:  # the Python API: the end of a first run's compiling goes to the logger
            report = lambda line: log.info(line) if line.startswith("compiled ") else None  # noqa: E731
        return build(self.dtype, stored, report)

    def encode(self, text: str | list[int]) -> list[int]:
        """Token ids of a prompt (text is encoded without special tokens, as a continuation), its last
        Settings.context of them when that is set."""
        ids = list(text) if isinstance(text, (list, tuple)) else self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise UserError("the prompt encodes to no tokens; give some text")
        context = self.run.context
        if context is not None:
            if context <= 0:
                raise UserError(f"Settings.context must be positive (got {context})")
            ids = ids[-context:]
        return ids

    def _check_host_memory(self, tokens: int) -> None:
        """Refuse, before allocating, a request whose weights and caches cannot fit in host memory."""
        if self.device != "cpu":
            return  # the device planner (offload) checks GPU memory
        cfg = self.config
        elem = torch.finfo(self.dtype).bits // 8
        params = cfg.parameters
        kv = cfg.kv_bytes(elem, tokens)
        weights = params * (elem + (1 if self.run.lower_weights == "int8" else 0))  # + the int8 copy
        need = weights * (1 if self.draft in ("self", "lookup") else 1.5) + kv
        available = host_available_bytes()
        if available is not None and need > available:
            raise UserError(f"this run needs about {_size(need)} of memory (weights + KV cache for {tokens} tokens) "
                            f"but {_size(available)} are available; lower Settings.context or use Settings.dtype bfloat16")

    def plan_generation(self):
        """The GenerationConfig for this session's prompt (triforce.cli.common.generation_plan); a prompt
        too short to retrieve from switches this session to the mode without the retrieval level."""
        self.run, cfg = generation_plan(self.run, len(self.prompt_ids), self.say if self.is_main else None)
        return cfg

    def generator(self, cfg, max_len: int, prefilled=None, mode: str | None = None, models=None) -> Generator:
        """The Generator generate.py decodes with: the offload factory, CUDA graphs. bench.py builds its
        systems here too, from a shared prefill (`prefilled`) and with each system's `mode`, so a
        benchmark times what generate.py runs for the same flags; `models`: another variant of the
        loaded models (sweep.py's lower weights)."""
        factory = None
        if self.run.offload == "host" and prefilled is None:  # a prefill brings its own full cache
            from triforce.offload import full_cache_factory

            factory = full_cache_factory(device=self.device, prefill_chunk=cfg.prefill_piece(self.device),
                                         onchip_layers=onchip_layers(self.run), chunk_tokens=self.run.offload_chunk)
        agree = self.dist.follow_main if self.dist and self.dist.world_size > 1 else None
        gen = Generator(models or self.loaded.models, cfg, mode or self.run.mode, max_len=max_len,
                        full_cache_factory=factory, prefilled=prefilled, agree=agree)
        self._last_full_cache = gen.full.cache
        if self.run.compile:
            from triforce.speculative.graphs import enable_compiled_passes

            enable_compiled_passes(gen)  # captured as CUDA graphs on a GPU as well
        elif self.cuda_graphs():
            from triforce.speculative.graphs import enable_cuda_graphs

            enable_cuda_graphs(gen)
        return gen

    def cuda_graphs(self) -> bool:
        """--cuda-graphs as asked, or by default on for one CUDA device: eager launches cost a small
        model's step several times its kernels' time. Off under tensor parallelism by default (its
        all-reduces would be captured inside the graphs: untested)."""
        on_cuda = str(self.device).startswith("cuda")
        if self.run.cuda_graphs and not on_cuda:
            raise UserError("Settings.cuda_graphs needs a CUDA device; leave it unset on CPU")
        if self.run.cuda_graphs is None:
            return on_cuda and self.run.tp == 1
        return self.run.cuda_graphs

    def report(self, cfg, tokens, text, stats) -> dict:
        run = self.run
        d = stats.to_dict()
        acc = d["acceptance"]
        return {
            "mode": run.mode, "adaptive": run.adaptive, "modes": d["modes"], "estimates": d["estimates"],
            "model": run.model, "draft": None if run.mode in ("autoregressive", "retrieval") else self.draft,
            "prompt_tokens": stats.prompt_tokens, "new_tokens": len(tokens), "tokens": tokens, "text": text,
            "prefill_seconds": stats.prefill_seconds, "decode_seconds": stats.decode_seconds,
            # where the prompt's K/V came from: a kept file ("loaded"), or a prefill kept for later ("kept")
            # that reused the first tokens of a kept prompt or checkpoint ("reused")
            "prompt_cache": {k: str(v) if isinstance(v, Path) else v
                             for k, v in getattr(self, "prompt_cache", {}).items()} or None,
            "tokens_per_second": stats.tokens_per_second,
            "acceptance": {"draft": acc.get("draft->middle", acc.get("draft->verify")),
                           "lookup": acc.get("lookup->middle", acc.get("lookup->verify")),
                           "middle": acc.get("middle->verify")},
            "tokens_per_full_pass": stats.tokens_per_full_pass, "full_passes": stats.full_passes,
            "bytes_moved": stats.bytes_moved,
            "offload": self._offload_timings(),
            "passes": d["passes"], "seconds": d["seconds"], "rebuilds": stats.rebuilds,
            "vs_plain": versus_plain(d, run.mode),
            "settings": {"dtype": run.dtype, "device": str(self.device), "threads": torch.get_num_threads(),
                         "threads_why": self.threads_why,
                         "temperature": cfg.temperature, "top_p": cfg.top_p, "budget": cfg.budget,
                         "chunk_size": cfg.chunk_size, "gamma1": cfg.gamma1, "gamma2": cfg.gamma2,
                         "rope_scaling": self.config.rope_scaling, "tp": self.dist.world_size if self.dist else 1,
                         "offload": run.offload, "lower_weights": run.lower_weights,
                         "weights": getattr(self, "weights", None), "kv_dtype": _dtype_name(getattr(self, "kv_dtype", None))},
        }

    def _offload_timings(self):
        cache = getattr(self, "_last_full_cache", None)
        return cache.timings() if cache is not None else None

    def choices(self, cfg=None) -> list[tuple[str, str]]:
        """The defaults this run decided (dtype, threads, sampling) and why, for the statistics."""
        run = self.run
        rows = [("dtype", run.dtype + (" (--dtype auto)" if self.asked_dtype == "auto" else "")),
                ("threads", f"{torch.get_num_threads()} ({self.threads_why})")]
        if str(self.device).startswith("cuda"):
            rows.append(("CUDA graphs", ("on" if self.cuda_graphs() else "off")
                         + (" (default: one GPU)" if self.run.cuda_graphs is None else "")))
        if getattr(self, "weights", None):
            rows.append(("weights", f"{self.weights['format']}, {self.weights['bytes_per_pass'] / 1e6:,.0f} MB read per pass"
                         + (" (--weights auto)" if run.weights == "auto" else "")))
        if getattr(self, "kv_dtype", None) is not None:
            rows.append(("KV cache", _dtype_name(self.kv_dtype) + (" (--kv-dtype auto)" if run.kv_dtype == "auto" else "")))
        if cfg is not None and drafts(run.mode):
            rows.append(("drafter", self._drafter_text(cfg)))
        if cfg is not None and run.mode == "triforce":
            device_rounds = cfg.rounds_on_device(self.device)
            rows.append(("drafter->middle rounds", ("on the device, one host read per full pass" if device_rounds
                                                    else "host-driven, a read per middle pass")
                         + ((" (default on a GPU)" if device_rounds else " (default on CPU)")
                            if run.device_rounds is None else "")))
        if cfg is not None and (run.mode == "autoregressive" or cfg.adaptive and run.tp == 1):
            ahead = cfg.queues_ahead(self.device)
            rows.append(("plain passes", ("the next queued before each token is read" if ahead else "one at a time")
                         + ((" (default on a GPU)" if ahead else " (default on CPU)") if run.queue_ahead is None else "")))
        if getattr(self, "prompt_cache", None) is not None:
            from .prompt_cache import describe

            rows.append(("prompt cache", describe(self.prompt_cache, run.prompt_cache)))
        if cfg is not None:
            rows.append(("sampling", "greedy" if cfg.temperature == 0 else
                         f"temperature {cfg.temperature:g}, top-p {cfg.top_p:g}" + (f", top-k {cfg.top_k}" if cfg.top_k else "")
                         + _verification_text(cfg, run.mode)))
        return rows

    def _drafter_text(self, cfg) -> str:
        """Which drafter proposes, for the statistics: a model folder's name, the target itself, or
        lookups; an adaptive run with a model drafter says it weighs lookups beside it."""
        draft = self.draft
        text = {"self": "the target itself (--draft self)", "lookup": "lookups in the text (--draft lookup)"}.get(
            draft, Path(draft).name)
        if draft != "lookup" and cfg.adaptive and cfg.lookup:
            text += ", with lookups weighed beside it (--no-lookup: without)"
        return text

    def close(self) -> None:
        if self.dist:
            self.dist.close()



def _set_threads(threads: int | None) -> str:
    """Set torch's CPU threads: as asked, else as OMP_NUM_THREADS says (a launcher sharing the cores
    between ranks), else the cores other work leaves free now (triforce/runtime/defaults.py). Returns why."""
    if threads is not None:
        torch.set_num_threads(threads)
        return "--threads"
    launcher = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()  # "4,2": nested levels, the first ours
    if launcher.isdigit() and int(launcher) >= 1:
        # set, not only read at torch's start: in a long-lived process an earlier session's threads
        # (or a variable set after torch loaded) would stand instead
        torch.set_num_threads(int(launcher))
        return "OMP_NUM_THREADS"
    threads, why = auto_threads()
    torch.set_num_threads(threads)
    return why


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point (small models need KiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} bytes"


def _setup_parallel(run: Settings):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if run.tp == 1 and world == 1:
        return None
    return setup_tensor_parallel(run.tp, run.device)


def _verification_text(cfg, mode: str) -> str:
    """How sampled drafts are verified, for the statistics' sampling row (nothing when none are)."""
    if cfg.temperature == 0 or mode == "autoregressive":
        return ""
    return "; drafts verified by block" if cfg.verification == "block" else "; drafts verified one at a time (--verification token)"


def open_session(run: Settings, text: str | None, modes=MODES, tokenizer=None) -> Session:
    """A session with its models loaded for `modes` (all of them unless said); `tokenizer`: the
    model's, when the caller has loaded it (Qwen's takes 2-4 s a load)."""
    return Session(run, text, tokenizer).load(modes)
