"""A run's settings, one frozen dataclass, and the rules that resolve what is left to the machine and
the prompt: per-device budget and gammas, the drafter beside a model, RoPE for the run's length.

The command line's flags and the Python API's keyword arguments fill the same `Settings`, so both
start the same engine (triforce.runtime.session.Session)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

from triforce.model.errors import UserError
from triforce.speculative.modes import retrieves

from . import defaults
from .defaults import DEFAULT_MODEL
from .text import read_text  # noqa: F401 (the front ends read prompts through settings)

NATURAL_DRAFTERS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}  # target folder -> drafter folder beside it

@dataclass(frozen=True)
class Settings:
    """One run's settings. The command line's flags take their defaults from here, and the Python
    API's keyword arguments fill the same fields, so both run the same engine. Nothing writes to it:
    a variant is made with dataclasses.replace; what a Session resolves ('auto' device, dtype,
    lower weights, threads) lives in the Session's copy. None means: decided for this run (said in
    its statistics): dtype and threads by the machine, budget and gammas by the device and prompt,
    sampling by the checkpoint, the drafter by the model folder."""
    # model
    model: str = str(DEFAULT_MODEL)
    draft: str | None = None  # a drafter folder, "self" (the target with a StreamingLLM cache), None: natural
    dtype: str = "auto"  # auto: bfloat16 on a GPU and on a CPU computing it natively, else float32
    device: str = "auto"
    threads: int | None = None  # None: the cores other work leaves free as the run starts
    rope_scaling: str = "auto"
    context: int | None = None  # keep the last N prompt tokens
    offload: str = "none"  # "host": the full KV cache in (pinned) host memory, streamed per pass
    onchip_layers: str = "0"
    offload_chunk: int = 4096
    cuda_graphs: bool | None = None  # None: on for a single CUDA device
    compile: bool = False  # each level's small passes as torch.compile'd graphs (seconds to compile per shape)
    device_rounds: bool | None = None  # triforce's drafter->middle rounds without host reads; None: on a GPU
    queue_ahead: bool | None = None  # plain passes (fixed or adaptive) queued before a token is read; None: on a GPU
    tp: int = 1
    lower_weights: str = "auto"  # the proposing levels' weights: auto (int8 on a bf16 CPU), same, int8
    weights: str = "auto"  # stored: compute with a GGUF's blocks (CPU); dequantized; auto: stored where it pays
    kv_dtype: str = "auto"  # the KV cache's dtype: auto (16 bits for float32 on a CPU where that pays), same, ...
    # generation
    mode: str = "triforce"
    max_new_tokens: int = 128
    temperature: float | None = None  # None: the checkpoint's generation_config.json (greedy if none)
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    budget: int | None = None
    chunk_size: int = 32
    gamma1: int | None = None
    gamma2: int | None = None
    draft_window: int = 256
    sinks: int = 4
    rebuild_threshold: float = 0.0
    prefill_chunk: int | None = None
    verification: str = "block"  # sampled drafts judged together (block) or one at a time (token)
    adaptive: bool = True  # each full pass runs the mode measured cheapest (lossless either way)
    # adaptive, with a model drafter: also weigh drafts looked up in the text in its place; None: not on
    # a GPU with the target drafting for itself (SELF_DRAFT_GPU_LOOKUP), else yes
    lookup: bool | None = None
    # generate and the Python API keep a prefilled prompt on disk, and the next run of the same prompt
    # loads it instead of prefilling: auto (a prefill that took PROMPT_CACHE_SECONDS or more), on, off
    prompt_cache: str = "auto"

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULTS = Settings()


def make_settings(values=None, sampling: str | None = "checkpoint", **overrides) -> Settings:
    """Settings from `values` (an argparse Namespace, a dict or None) and keyword `overrides`; a name
    that is not a setting is refused, naming the ones that exist. Sampling left unset is filled by
    `sampling`: "checkpoint" (the checkpoint's generation_config.json: generate and chat with a
    prompt of the user's), "model" (temperature 1: the model's own distribution) or "greedy"
    (measuring tools compare engines token for token); None leaves them unset."""
    names = {f.name for f in fields(Settings)}
    given = dict(values) if isinstance(values, dict) else (
        {n: getattr(values, n) for n in names if hasattr(values, n)} if values is not None else {})
    given.update(overrides)
    unknown = sorted(set(given) - names)
    if unknown:
        raise UserError(f"unknown setting {', '.join(unknown)}; the settings are: {', '.join(sorted(names))}")
    settings = Settings(**given)
    if sampling is not None and None in (settings.temperature, settings.top_p, settings.top_k):
        settings = with_sampling(settings, sampling)
    return settings


def with_sampling(settings: Settings, sampling: str) -> Settings:
    """temperature / top_p / top_k left None, filled by the rule `sampling` (see make_settings)."""
    chosen = {"checkpoint": lambda: defaults.checkpoint_sampling(settings.model),
              "model": lambda: {"temperature": 1.0}, "greedy": lambda: {"temperature": 0.0}}[sampling]()
    filled = {name: chosen.get(name, fallback) for name, fallback in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0))
              if getattr(settings, name) is None}
    return replace(settings, **filled)


def run_config(args, sampling: str = "greedy", **derived) -> Settings:
    """Settings of parsed flags; `derived` holds values a front end computes instead of taking them as
    given (bench.py's --new-tokens is the number of new tokens)."""
    return make_settings(args, sampling, **derived)


# Defaults from the sweeps in docs/results/2026-11-23-cpu-epyc-2core.md ("Choosing the defaults"). On CPU every level reads the same
# weights, so a middle pass costs the weights plus its budget of KV and the full pass the weights plus
# the whole context: a bigger budget buys acceptance cheaply at long context (32K: 0.79 at 8,192 vs
# 0.51 at 2,048) and short middle runs (gamma2 3) beat long ones; with the target drafting for itself a
# draft pass costs a middle pass, so triforce drafts 2 at a time. Chunks of 32 tokens scored better
# than 8 (4K: middle acceptance 0.85 vs 0.80), on either device. On a GPU the full pass streams the KV
# from host memory and dwarfs the others: TriForce's longer gamma2, and a middle pass costs its kernels,
# not its budget (SmolLM2's: 1.9 ms at 4K and at 32K on the H200), so the budget follows the context
# as on CPU, a quarter of it, from 4,096 up to 8,192 (TriForce's offloaded setting on one RTX 4090,
# docs/design.md). SmolLM2 at 32K (Moby Dick, exact weights, gamma2 6; bench.sweep,
# results/sweep-32k-budgets-s24.json) made 4.88 tokens per full pass at 4,096, 6.05 at 8,192 and 6.05
# at 16,384 greedy, 5.08 / 6.68 / 6.35 sampled at 0.8. A default keeps the retrieval cache within
# GPU_RETRIEVAL_BYTES, that setting's 4 GiB for Llama-2-7B (512 KiB a token): Llama-2-13B gets less.
CPU_BUDGET_FRACTION, CPU_BUDGET_RANGE = 4, (1024, 8192)
GPU_BUDGET_RANGE, GPU_RETRIEVAL_BYTES = (4096, 8192), 4 * 2**30
DEFAULT_GAMMAS = {"cpu": {"speculative": (4, 0), "retrieval": (0, 3), "triforce": (2, 3), "autoregressive": (0, 0)},
                  "cuda": {"speculative": (4, 0), "retrieval": (0, 6), "triforce": (4, 6), "autoregressive": (0, 0)}}
# With the KV in host memory on a GPU a full pass costs the link (SmolLM2 at 32K: 14 ms on the H200,
# a middle pass 1.6 ms), so the middle level proposes TriForce's offloaded 16 a pass: retrieval and
# the adaptive default, whose chooser takes gamma2 as its cap and picks each pass's length below it.
# Session 37 (H200, 32K, x plain decoding beside session 36's gamma2 6; docs/results/
# 2026-11-27-gpu-h200-compiled-and-gamma2.md): retrieval 3.46x -> 4.37x greedy, 2.75x -> 3.09x
# sampled; adaptive 4.03x -> 3.87x greedy, 2.19x -> 2.77x sampled. Triforce run fixed keeps 6: at 16
# it made 4.01x greedy (3.82x) but 0.81x sampled (1.40x), its drafter accepting 0.18 there.
OFFLOADED_GAMMA2 = 16
# Triforce run fixed on a GPU with the target drafting for itself drafts one token a round. A round of
# g drafts costs g drafter passes c_d and the middle level's check m, and makes E_g = 1 + s_1 + ... +
# s_g middle tokens (s_j: the chance that the first j drafts stand, non-increasing, so E_g <= 1 + g s_1).
# Then E_g (c_d + m) - E_1 (g c_d + m) <= (g - 1)(s_1 m - c_d): g drafts make middle tokens no faster
# than one wherever s_1 m <= c_d. On a GPU a pass of SmolLM2 costs its kernels, not what it reads:
# session 36 (H200, 32K, KV in host memory, gamma2 6) timed a round of 4 drafts at 9.9 ms and one of
# 4 looked-up drafts (no pass) at 3.9, so c_d = 1.5 and m = 3.9 ms. Sampled, the drafter accepted
# 0.16-0.18: s_1 m = 0.6-0.7 < c_d, and triforce made 1.40x plain decoding at gamma2 6 (0.81x at 16).
# One draft a round projects to 1.83-2.07x at 6 (results/gamma1-projection-s39.py); greedy, where it
# accepted 0.86 (a loop), 3.77x against the 3.82x measured. The next lease measures both side by side
# (bench system triforce-gamma1-4). A drafter of its own (llama-68m beside Llama-2-7B: 0.21 ms against
# 6.15) keeps 4, as do an adaptive run weighing lookups (they cost no pass and pay with longer runs) and a
# CPU, where a middle pass also reads its budget of KV (32K: 93-98 ms against the drafter's 45-57).
SELF_DRAFT_GPU_GAMMA1 = 1
# The adaptive default on a GPU with the target drafting for itself weighs no lookups (--lookup: it
# does). There retrieval beats every other plan at long context, and a chooser weighing lookups and
# lookup-fed triforce beside it spent its 64-token runs trying them: a bad plan's rounds, and the CUDA
# graphs of its new pass widths captured inside the answer (100+ ms each). SmolLM2 at 32K, the KV in
# host memory, on H200s, x plain decoding, with lookups weighed / without, in the same run:
#   session 36 (gamma2 6):  greedy 1.53 / 2.75, 4.03 / 4.09;  sampled 1.65 / 1.48, 2.19 / 2.40
#   session 40 (gamma2 16): greedy 2.15 / 4.18;               sampled 1.06 / 2.67
# (results/gpu-2026-11-27-h200-{b,d}.json, results/gpu-2026-11-27-h200-s40-b.json): 2.10x against
# 2.93x on average, 5 of 6 pairs. Lookups still serve a CPU, where a middle pass reads its budget of
# KV and a lookup costs nothing, and `--draft lookup`. The bench system adaptive-lookup keeps the
# setting before, for the next lease to time beside the default.
SELF_DRAFT_GPU_LOOKUP = False


def default_budget(prompt_len: int, chunk: int, gpu: bool, kv_token_bytes: int = 0) -> int:
    """A quarter of the prompt in whole chunks, within the device's range; on a GPU no more than
    GPU_RETRIEVAL_BYTES of retrieval cache at `kv_token_bytes` (K and V of a token, every layer)."""
    low, high = GPU_BUDGET_RANGE if gpu else CPU_BUDGET_RANGE
    if gpu and kv_token_bytes:
        high = max(low, min(high, GPU_RETRIEVAL_BYTES // kv_token_bytes // chunk * chunk))
    return min(max(prompt_len // CPU_BUDGET_FRACTION // chunk * chunk, low), high)


def kv_token_bytes(model: str) -> int:
    """K and V of one token in every layer at 16 bits, from the model folder's config; 0 where it
    cannot be read (loading the model names that problem)."""
    from triforce.model.config import ModelConfig

    if not model:
        return 0
    try:
        cfg = ModelConfig.from_folder(model)
    except UserError:
        return 0
    return cfg.kv_bytes_per_token


def generation_config(run: Settings, prompt_len: int, say: Callable[[str], None] | None = None):
    """GenerationConfig of a run. A default budget shrinks to fit a short prompt (said on stderr);
    a budget the user chose is checked as given."""
    from triforce.parallel import resolve_device
    from triforce.speculative import GenerationConfig
    from triforce.speculative.retrieval import MIN_CHUNKS

    gpu = resolve_device(run.device).startswith("cuda")
    g1, g2 = DEFAULT_GAMMAS["cuda" if gpu else "cpu"][run.mode]
    self_draft = gpu and resolve_draft(run.model, run.draft) == "self"
    lookup = run.lookup if run.lookup is not None else SELF_DRAFT_GPU_LOOKUP if self_draft else True
    # an adaptive run weighing lookups drafts them gamma1 at a time too (they cost no pass)
    if self_draft and run.mode == "triforce" and not (run.adaptive and lookup):
        g1 = SELF_DRAFT_GPU_GAMMA1
    if gpu and g2 and run.offload == "host" and (run.adaptive or run.mode == "retrieval"):
        g2 = OFFLOADED_GAMMA2
    budget = run.budget
    if budget is None:  # a chunk size <= 0 is refused by GenerationConfig, naming it
        chunk = max(run.chunk_size, 1)
        budget = default_budget(prompt_len, chunk, gpu, kv_token_bytes(run.model) if gpu else 0)
        if retrieves(run.mode) and budget >= prompt_len:
            budget = max(MIN_CHUNKS * chunk, (prompt_len // 2) // chunk * chunk)
            if say and budget < prompt_len:
                say(f"prompt has {prompt_len} tokens; retrieval budget set to {budget}")
    return GenerationConfig(
        max_new_tokens=run.max_new_tokens, temperature=run.temperature, top_p=run.top_p, top_k=run.top_k,
        seed=run.seed, budget=budget, chunk_size=run.chunk_size,
        gamma1=run.gamma1 if run.gamma1 is not None else max(g1, 1),
        gamma2=run.gamma2 if run.gamma2 is not None else max(g2, 1),
        draft_window=run.draft_window, sink_tokens=run.sinks, rebuild_threshold=run.rebuild_threshold,
        prefill_chunk=run.prefill_chunk,  # None: the device's default piece (GenerationConfig.prefill_piece)
        verification=run.verification, adaptive=run.adaptive, lookup=lookup, device_rounds=run.device_rounds,
        queue_ahead=run.queue_ahead)


def generation_plan(run: Settings, prompt_len: int, say: Callable[[str], None] | None = None):
    """(run, GenerationConfig) for a prompt of `prompt_len` tokens, checked before the weights load.
    A prompt too short to retrieve from (not longer than the retrieval budget a default would pick)
    runs the mode without the retrieval level, said in one line; a budget the user chose is checked
    against the prompt as given, so a mistake is named rather than worked around."""
    from triforce.speculative.retrieval import check_budget, mode_for_prompt

    cfg = generation_config(run, prompt_len, say)
    if retrieves(run.mode) and run.budget is None:
        mode, note = mode_for_prompt(run.mode, cfg.budget, cfg.chunk_size, prompt_len)
        if note:
            if say:
                say(note)
            run = replace(run, mode=mode)
            cfg = generation_config(run, prompt_len)
    if retrieves(run.mode):
        check_budget(cfg.budget, cfg.chunk_size, prompt_len)
    return run, cfg


def resolve_draft(model: str, draft: str | None) -> str:
    if draft is not None:
        return draft
    natural = NATURAL_DRAFTERS.get(Path(model).name)
    if natural and (Path(model).parent / natural).is_dir():
        return str(Path(model).parent / natural)
    return "self"


def resolve_rope(cfg, needed: int, spec: str, say: Callable[[str], None] | None = None, new_tokens: int = 0):
    """The model config with the RoPE scaling `spec` applied for a sequence of `needed` tokens
    (model.rope.scaled_for, the rule the Python API applies too); a scaling it adds is said in one line."""
    from triforce.model.rope import scaled_for

    scaled, note = scaled_for(cfg, needed, spec, new_tokens)
    if note and say:
        say(note)
    return scaled


def context_positions(cfg, spec: str) -> int:
    """The most positions a run may use with --rope-scaling `spec`: with auto (the default) as far as
    the YaRN scaling it adds supports; with none, the checkpoint's own (its config's scaling
    included); else those of yarn:F / linear:F."""
    from triforce.model.rope import max_auto_positions

    if spec == "auto":
        return max_auto_positions(cfg)
    return cfg.max_positions if spec == "none" else resolve_rope(cfg, 0, spec).max_positions



def check_flags(run: Settings) -> None:
    """Every setting that can be checked without reading a file, refused before anything loads (the
    command line calls this before importing torch): numbers in range, names that exist."""
    from triforce.speculative.modes import MODES

    checks = [
        (run.mode in MODES, f"Settings.mode '{run.mode}' is not a mode: choose one of {', '.join(MODES)}"),
        (run.max_new_tokens >= 1, f"Settings.max_new_tokens must be >= 1 (got {run.max_new_tokens})"),
        (run.threads is None or run.threads >= 1,
         f"Settings.threads must be at least 1 (got {run.threads}); leave it out for the machine's choice"),
        (run.offload_chunk >= 1, f"Settings.offload_chunk must be a positive number of tokens (got {run.offload_chunk})"),
        (run.context is None or run.context >= 1, f"Settings.context must be positive (got {run.context})"),
        (run.temperature is None or run.temperature >= 0,
         f"temperature must be >= 0 (got {run.temperature}); use 0 for greedy"),
        (run.top_p is None or 0 < run.top_p <= 1, f"top-p must be in (0, 1] (got {run.top_p})"),
        (run.top_k is None or run.top_k >= 0, f"top-k must be >= 0 (got {run.top_k}); 0 turns it off"),
        (run.gamma1 is None or run.gamma1 >= 1, f"gamma1 must be >= 1 (got {run.gamma1})"),
        (run.gamma2 is None or run.gamma2 >= 1, f"gamma2 must be >= 1 (got {run.gamma2})"),
        (run.budget is None or run.budget >= 1, f"Settings.budget must be a positive number of tokens (got {run.budget})"),
        (run.chunk_size >= 1, f"chunk size must be > 0 (got {run.chunk_size})"),
        (run.draft_window >= 1, f"draft window must be >= 1 (got {run.draft_window})"),
        (run.sinks >= 0, f"sink tokens must be >= 0 (got {run.sinks})"),
        (0 <= run.rebuild_threshold <= 1, f"rebuild threshold must be in [0, 1] (got {run.rebuild_threshold})"),
        (run.prefill_chunk is None or run.prefill_chunk >= 1, f"prefill chunk must be >= 1 (got {run.prefill_chunk})"),
        (run.tp >= 1, f"Settings.tp must be at least 1 (got {run.tp})"),
        # a rank's passes sum their shards through all-reduce hooks, which graphs would skip or trace:
        # they run eagerly (model/eager_steps.watched), so the flags could only be ignored
        (run.tp == 1 or not run.compile, f"Settings.compile does not apply under tensor parallelism (Settings.tp "
         f"{run.tp}): each rank's passes run eagerly around their all-reduces; leave Settings.compile off"),
        (run.tp == 1 or not run.cuda_graphs, f"Settings.cuda_graphs does not apply under tensor parallelism "
         f"(Settings.tp {run.tp}): each rank's passes run eagerly around their all-reduces; leave it unset"),
        (run.weights in ("auto", "stored", "dequantized"),
         f"Settings.weights '{run.weights}' is not one of auto, stored, dequantized"),
        (run.kv_dtype in ("auto", "same", "bfloat16", "float16", "float32"),
         f"Settings.kv_dtype '{run.kv_dtype}' is not one of auto, same, bfloat16, float16, float32"),
        (run.prompt_cache in ("auto", "on", "off"), f"Settings.prompt_cache '{run.prompt_cache}' is not one of auto, on, off"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    onchip_layers(run)


def onchip_layers(run: Settings) -> int | str:
    """Settings.onchip_layers: 'auto' or a number of layers."""
    value = run.onchip_layers
    if value == "auto":
        return value
    try:
        layers = int(value)
    except ValueError:
        layers = -1
    if layers < 0:
        raise UserError(f"Settings.onchip_layers must be 'auto' or a number of layers >= 0 (got {value!r})")
    return layers


