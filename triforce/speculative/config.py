"""The generation settings: one dataclass, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from triforce.model.errors import UserError

from .retrieval import check_budget_shape
from .sampling import VERIFICATION_RULES

# Prefill pieces: on CPU a prompt of up to 4,096 tokens goes in one piece, whose attention runs as a
# causal kernel (bench/prefill_rate.py: 1.0-1.8x transformers' rate, SmolLM2 and Qwen2.5-0.5B, fp32
# and bf16, 4K tokens, against 0.45x in pieces of 512); later pieces attend to the cache with the
# past and the piece merged (model/attention.py). On a GPU later pieces take a fused kernel with the
# causal diagonal aligned to the last key, no (piece x context) mask (attention.attend_shared_heads);
# with the KV in host memory every piece streams the whole past once, so the bytes a prefill moves
# fall as the piece grows (N^2 / 2 piece tokens: 2.2 TB at 128K for Llama-3-8B in pieces of 512, 0.55 TB
# in pieces of 2,048). 2,048 keeps a piece's activations inside the planner's 512 MiB workspace at
# Llama-3-8B's width (the gate/up product of 2,048 rows is 117 MB).
CPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK = 4096, 2048


@dataclass
class GenerationConfig:
    """Everything an engine needs besides the models; validated at construction."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    # retrieval cache (middle level)
    budget: int = 2048
    chunk_size: int = 32  # the front ends' defaults and why: triforce/runtime/settings.py
    rebuild_threshold: float = 0.0  # rebuild when middle acceptance over recent rounds drops below this
    # speculation lengths: gamma1 drafter tokens per middle pass, gamma2 middle tokens per full pass
    gamma1: int = 2
    gamma2: int = 3
    # StreamingLLM cache for the drafter
    sink_tokens: int = 4
    draft_window: int = 256
    prefill_chunk: int | None = None  # prompt tokens per prefill forward; None: prefill_piece(device)
    # each full pass runs whichever mode of the built levels measures cheapest (speculative/adaptive.py).
    # Lossless either way, but which passes ran depends on timings, so a seed fixes a sampled run's
    # distribution, not its text. Off here (an engine asked for a mode runs that mode: tests, benchmarks);
    # generate.py and chat.py turn it on (--adaptive, their default)
    adaptive: bool = False
    # an adaptive run whose drafter is a model also weighs lookups in its place (modes.LOOKUP_VARIANT)
    lookup: bool = True
    # an adaptive run may verify up to this many lookups in one full pass (gamma2 for a model's
    # drafts): a lookup costs no pass, and after a long match it is right for long runs (a quotation)
    lookup_gamma: int = 8
    stop_on_eos: bool = False
    # how a sampled level verifies drafts (sampling.py): "block" judges them together and accepts more
    # (never fewer in expectation); "token" is speculative sampling's rule, one draft at a time
    verification: str = "block"
    # triforce's drafter->middle rounds with no host read inside (rounds.py): None decides by device
    device_rounds: bool | None = None
    # plain decoding queues each full pass before the host reads the token the last one sampled
    # (engine.Generator._queued_tokens), run fixed or chosen by an adaptive run: None decides by device
    queue_ahead: bool | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1 (got {self.max_new_tokens})"),
            (self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature}); use 0 for greedy"),
            (0 < self.top_p <= 1, f"top-p must be in (0, 1] (got {self.top_p})"),
            (self.top_k >= 0, f"top-k must be >= 0 (got {self.top_k}); 0 turns it off"),
            (self.gamma1 >= 1, f"gamma1 must be >= 1 (got {self.gamma1})"),
            (self.gamma2 >= 1, f"gamma2 must be >= 1 (got {self.gamma2})"),
            (self.verification in VERIFICATION_RULES,
             f"verification must be one of {', '.join(VERIFICATION_RULES)} (got {self.verification!r})"),
            (self.lookup_gamma >= 1, f"lookup gamma must be >= 1 (got {self.lookup_gamma})"),
            (self.sink_tokens >= 0, f"sink tokens must be >= 0 (got {self.sink_tokens})"),
            (self.draft_window >= 1, f"draft window must be >= 1 (got {self.draft_window})"),
            (0 <= self.rebuild_threshold <= 1, f"rebuild threshold must be in [0, 1] (got {self.rebuild_threshold})"),
            (self.prefill_chunk is None or self.prefill_chunk >= 1,
             f"prefill chunk must be >= 1 (got {self.prefill_chunk})"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        check_budget_shape(self.budget, self.chunk_size)

    def prefill_piece(self, device) -> int:
        """Prompt tokens per prefill forward on `device`: the setting, else the device's default."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return GPU_PREFILL_CHUNK if str(device).startswith("cuda") else CPU_PREFILL_CHUNK

    def rounds_on_device(self, device) -> bool:
        """Whether triforce's drafter->middle rounds run without host reads: the setting, else on a
        GPU, where every read stalls the queue (on CPU a read costs nothing and the host-driven
        rounds waste no proposals)."""
        if self.device_rounds is not None:
            return self.device_rounds
        return str(device).startswith("cuda")

    def queues_ahead(self, device) -> bool:
        """Whether plain decoding keeps a pass queued ahead of the host: the setting, else on a GPU,
        where the host's work between passes (reading the token, committing it, launching the next
        pass: 0.16 ms a token at 4K on the H200) otherwise leaves the device idle. On CPU a pass is
        done when its call returns, so there is nothing to overlap, and a pass queued past a stop
        token would only be wasted."""
        if self.queue_ahead is not None:
            return self.queue_ahead
        return str(device).startswith("cuda")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
