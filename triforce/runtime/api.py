"""The Python API: the command line's engine, called from Python.

    import triforce
    result = triforce.generate("The capital of France is", max_new_tokens=8)
    result = triforce.generate(prompt_file="book.txt", context=16384, mode="retrieval", temperature=0)
    result.tokens, result.text, result.settings, result.stats.to_dict()

Keyword arguments are `triforce.Settings` fields (the command line's flags, with underscores), and
every default is the command line's: dtype, threads and the proposers' int8 weights by the machine,
budget and gammas by the device and prompt, sampling by the checkpoint, the drafter by the model,
the adaptive mode choice, RoPE scaling for the run's length. `triforce.generate()` with no prompt
runs the command line's embedded job. Notes (a setting adjusted, RoPE scaling added) go to the
`triforce` logger as warnings.

For the OpenMP threads that torch starts to sleep rather than spin while they wait (which matters on
a machine with other work), set OMP_WAIT_POLICY=PASSIVE before importing torch; the command-line
entry points do (triforce.cli.prepare_process). Importing triforce changes no environment; a
Session (and so `generate`) makes glibc's malloc keep freed memory for the next tensors
(triforce/runtime/memory.py: a prefill faulted its pages in again every layer), unless
TRIFORCE_REUSE_MEMORY=0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch loads with the engine, not with the settings
    from triforce.speculative.config import GenerationConfig
    from triforce.speculative.stats import Stats

from .defaults import DEFAULT_PROMPT_FILE
from .settings import Settings, make_settings, with_sampling
from .text import StreamingText, read_prompt_file

EMBEDDED_CONTEXT = 4096  # the embedded job continues the last 4,096 tokens of a book's first chapters


@dataclass
class Result:
    tokens: list[int]  # the new tokens
    text: str
    stats: "Stats"
    settings: dict  # what the run resolved: dtype, device, threads, budget, gammas, mode, sampling ...
    report: dict  # everything `triforce generate --json` prints
    config: "GenerationConfig"  # the engine's settings, as resolved


def embedded_job(settings: Settings) -> Settings:
    """The main job's settings when no prompt is given: the last 4,096 tokens of the shipped book
    prefix, continued with the model's own distribution (temperature 1) unless sampling is set: on a
    novel's continuation SmolLM2 loops under greedy decoding and under its model card's chat
    settings (triforce.runtime.defaults)."""
    context = EMBEDDED_CONTEXT if settings.context is None else settings.context
    if settings.temperature is not None:
        return replace(settings, context=context)
    return replace(settings, context=context, temperature=1.0,  # the model's own distribution, whole
                   top_p=1.0 if settings.top_p is None else settings.top_p, top_k=settings.top_k or 0)


def job_settings(run: Settings, embedded: bool) -> Settings:
    """A run's settings as the main job resolves them, on the command line and in Python alike: the
    embedded job's context and sampling when no prompt is given, then the checkpoint's sampling for
    whatever is still unset."""
    return with_sampling(embedded_job(run) if embedded else run, "checkpoint")


def generate(prompt: str | list[int] | None = None, *, prompt_file: str | Path | None = None,
             on_tokens: Callable[[list[int], list[str]], None] | None = None,
             on_text: Callable[[str], None] | None = None, on_prefill: Callable[[int], None] | None = None,
             **settings) -> Result:
    """Generate from a prompt (text, token ids or a file; none: the embedded job) with `settings`.

    on_tokens(tokens, levels): each batch of committed tokens and the level that proposed each;
    on_text(piece): the text as it becomes final; on_prefill(n): n more prompt tokens in the cache (0
    when the prefill starts, then in one call those reused from a kept prompt or a checkpoint, then
    each piece computed: runtime/prefill.py), not called for a prompt loaded whole from the prompt
    cache (runtime/prompt_cache.py, Settings.prompt_cache)."""
    if prompt is not None and prompt_file is not None:
        raise ValueError("give a prompt or a prompt_file, not both")
    run = job_settings(make_settings(None, None, **settings), embedded=prompt is None and prompt_file is None)
    note = None
    if prompt is None:
        prompt, note = read_prompt_file(prompt_file or DEFAULT_PROMPT_FILE)
    from .session import Session

    session = Session(run, prompt)
    if note and session.is_main:
        session.say(note)
    try:
        return run_generation(session, on_tokens, on_text, on_prefill)
    finally:
        session.close()


def run_generation(session, on_tokens=None, on_text=None, on_prefill=None, watch_prefill=None) -> Result:
    """A session's whole run: plan (bad settings are refused before the weights load), load the
    levels its mode proposes with, prefill, generate. The command line's `generate` is this.
    `watch_prefill(model)`: a context manager around the prefill given the model it runs (the
    command line's bar watches its layers, to move within a long piece)."""
    from . import learned, prompt_cache
    from .prefill import prefill

    cfg = session.plan_generation()
    session.load(modes=(session.run.mode,))
    gen = session.generator(cfg, max_len=len(session.prompt_ids) + session.run.max_new_tokens)
    session.prompt_cache = {"loaded": prompt_cache.restore(session, gen), "kept": None, "reused": 0}
    if session.prompt_cache["loaded"] is None:
        _, session.prompt_cache["kept"] = prefill(session, gen, on_prefill, watch_prefill)
    learned_file = learned.start_for_prompt(session, gen)
    stream = StreamingText(session.tokenizer)

    def committed(tokens, levels):
        if on_tokens:
            on_tokens(tokens, levels)
        piece = stream.push(tokens)
        if on_text and piece:
            on_text(piece)

    tokens = gen.generate(on_tokens=committed)
    if learned_file is not None:
        learned.save(learned_file, gen, learned.threads())
    rest = stream.rest()
    if on_text and rest:
        on_text(rest)
    report = session.report(cfg, tokens, stream.text(), gen.stats)
    return Result(tokens, report["text"], gen.stats, report["settings"], report, cfg)
