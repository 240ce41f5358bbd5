"""A bandwidth cost model of long-context decoding: a PROJECTION, not a measurement.

Decoding at long context is memory-bound, so a forward pass costs the bytes it must read divided by
the bandwidth of wherever those bytes live, plus a fixed per-pass overhead (kernel launches,
collectives). The model predicts per-token latency for

    autoregressive, KV offloaded    every token: weights (GPU memory) + on-chip KV layers (GPU memory)
                                    + off-chip KV layers (over PCIe, each GPU over its own link)
    DeepSpeed ZeRO-Inference        every token: all weights over PCIe + the whole KV read by the CPU
                                    (attention on the CPU, at host-memory bandwidth), one GPU
    on-chip autoregressive          every token: weights + whole KV from GPU memory
    triforce                        per verification: one full pass as above, plus
                                    gamma2 / E1 middle passes (weights + budget KV from GPU memory)
                                    and as many times gamma1 drafter passes (tiny);
                                    divided by the E2 tokens a verification yields

with E = (1 - a^(g+1)) / (1 - a) tokens per verification of g proposals accepted each with rate a
(the accepted prefix plus the bonus/corrected token).

Calibration (see `PUBLISHED` and `calibrate`): the figures of the TriForce rows (docs/design.md,
section "Published results") are reproduced from spec-sheet bandwidths, PCIe at the 25 GB/s the design notes state, the on-chip
layer counts of the published commands, and a few fitted constants that the publication does not
state: the middle-level acceptance (one value for all rows), a per-GPU memory reserve (from the
published on-chip layer counts) and the effective host-memory bandwidth of DeepSpeed's CPU attention
(from its single row, so that row agrees by construction).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from triforce.model.config import kv_bytes_per_token, parameter_count
from triforce.speculative.pricing import seconds_per_token, tokens_per_verification  # noqa: F401 (re-exported)

GB = 1e9


# ---------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied_embeddings: bool = False
    bytes_per_value: int = 2  # fp16/bf16 weights and KV

    def __post_init__(self):
        for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "intermediate", "bytes_per_value"):
            if getattr(self, k) <= 0:
                raise ValueError(f"{k} must be positive (got {getattr(self, k)})")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.heads} heads is not a multiple of {self.kv_heads} KV heads")

    @property
    def params(self) -> int:
        return parameter_count(self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                               self.vocab, self.tied_embeddings)

    @property
    def weight_bytes(self) -> int:
        return self.params * self.bytes_per_value

    @property
    def weight_bytes_read(self) -> int:
        """Weight bytes one forward pass reads: all but the embedding table, of which it reads a few
        rows (unless tied, when the same matrix is read whole as the output head)."""
        embed = 0 if self.tied_embeddings else self.vocab * self.hidden
        return (self.params - embed) * self.bytes_per_value

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token, all layers."""
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.bytes_per_value)

    def kv_bytes(self, tokens: int) -> int:
        return self.kv_bytes_per_token * tokens

    @classmethod
    def from_config(cls, cfg, name: str = "", bytes_per_value: int = 2) -> "ModelShape":
        """From a `speculative.ModelConfig`."""
        return cls(name or cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, cfg.vocab_size, cfg.intermediate_size, cfg.tie_word_embeddings, bytes_per_value)


def llama(name, layers, hidden, heads, inter, vocab=32000, kv_heads=None) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, kv_heads or heads, hidden // heads, vocab, inter)


LLAMA2_7B = llama("Llama2-7B-128K", 32, 4096, 32, 11008)
LWM_7B = replace(LLAMA2_7B, name="LWM-Text-Chat-128K")  # a Llama2-7B fine-tune: same shapes
LLAMA2_13B = llama("Llama2-13B-128K", 40, 5120, 40, 13824)
LLAMA_68M = llama("JackFram/llama-68m", 2, 768, 12, 3072)  # the published drafter
SHAPES = {s.name: s for s in (LLAMA2_7B, LWM_7B, LLAMA2_13B, LLAMA_68M)}


# -------------------------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Hardware:
    """Per-GPU figures; `tp` GPUs each hold 1/tp of the weights and KV and have their own PCIe link."""

    name: str
    gpu_bw: float  # GPU memory bandwidth, bytes/s (spec sheet)
    pcie_bw: float  # effective host->GPU bandwidth per link, bytes/s
    gpu_mem: float  # bytes per GPU
    tp: int = 1
    onchip_layers: int | None = None  # layers whose full KV stays in GPU memory; None: as many as fit
    host_bw: float = 70 * GB  # effective host-memory bandwidth of CPU attention (DeepSpeed row), fitted
    pass_overhead: float = 2e-3  # seconds per target forward pass (launches, all-reduces; no CUDA graphs)
    draft_overhead: float = 0.5e-3  # seconds per drafter forward pass
    reserve: float = 6 * GB  # per-GPU memory kept for activations/workspace, fitted to published on-chip layers

    def __post_init__(self):
        if min(self.gpu_bw, self.pcie_bw, self.gpu_mem, self.host_bw) <= 0 or self.tp < 1:
            raise ValueError(f"hardware {self.name}: bandwidths and memory must be positive and tp >= 1")

    def with_(self, **kw) -> "Hardware":
        return replace(self, **kw)


RTX4090 = Hardware("RTX 4090", gpu_bw=1008 * GB, pcie_bw=25 * GB, gpu_mem=24 * 2**30)
A100_80G = Hardware("A100 80GB", gpu_bw=2039 * GB, pcie_bw=25 * GB, gpu_mem=80 * 2**30, pass_overhead=0.3e-3,
                    draft_overhead=0.2e-3)  # CUDA graphs on A100
H100 = Hardware("H100 80GB", gpu_bw=3350 * GB, pcie_bw=50 * GB, gpu_mem=80 * 2**30, pass_overhead=0.3e-3,
                draft_overhead=0.2e-3)
HARDWARE = {"4090": RTX4090, "a100": A100_80G, "h100": H100}


# ------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Setting:
    model: ModelShape
    hw: Hardware
    context: int  # tokens in the full KV cache
    budget: int = 12288  # retrieval cache tokens (middle level)
    gamma1: int = 1  # drafter tokens per middle pass (the published code verifies each one)
    gamma2: int = 16  # middle tokens per full-cache verification
    accept_middle: float = 0.9  # per-token acceptance, middle -> full verification
    accept_draft: float = 0.6  # per-token acceptance, drafter -> middle
    drafter: ModelShape | None = LLAMA_68M
    draft_window: int = 256  # StreamingLLM cache of the drafter
    offloaded: bool = True  # False: the whole KV lives in GPU memory (on-chip)

    def __post_init__(self):
        if self.context <= 0 or self.budget <= 0 or self.gamma1 < 1 or self.gamma2 < 1:
            raise ValueError("context, budget must be positive and gammas >= 1")
        for a in (self.accept_middle, self.accept_draft):
            if not 0 <= a <= 1:
                raise ValueError(f"acceptance rates are in [0, 1] (got {a})")


def onchip_layers(s: Setting, budget: int | None = None, with_drafter: bool = True) -> int:
    """Layers of the full KV cache that fit in GPU memory after weights, the retrieval cache, the
    drafter and the reserve (per GPU, tensor-parallel shards), unless the hardware fixes the count."""
    hw, m = s.hw, s.model
    if hw.onchip_layers is not None:
        return min(hw.onchip_layers, m.layers)
    if not s.offloaded:
        return m.layers
    budget = s.budget if budget is None else budget
    used = m.weight_bytes / hw.tp + m.kv_bytes(budget) / hw.tp + hw.reserve
    if with_drafter and s.drafter is not None:
        used += s.drafter.weight_bytes + s.drafter.kv_bytes(s.draft_window)
    per_layer = m.kv_bytes(s.context) / m.layers / hw.tp
    return max(0, min(m.layers, int((hw.gpu_mem - used) // per_layer)))


# ------------------------------------------------------------------------------------ pass costs (s)
def full_pass_seconds(s: Setting, onchip: int | None = None) -> float:
    """One pass of the target over the whole KV cache (one token or a verification: memory-bound)."""
    hw, m = s.hw, s.model
    if onchip is None:
        onchip = onchip_layers(s)
    per_layer = m.kv_bytes(s.context) / m.layers / hw.tp
    gpu_bytes = m.weight_bytes_read / hw.tp + onchip * per_layer
    pcie_bytes = (m.layers - onchip) * per_layer if s.offloaded else 0.0
    return gpu_bytes / hw.gpu_bw + pcie_bytes / hw.pcie_bw + hw.pass_overhead


def middle_pass_seconds(s: Setting) -> float:
    hw, m = s.hw, s.model
    return (m.weight_bytes_read + m.kv_bytes(s.budget)) / hw.tp / hw.gpu_bw + hw.pass_overhead


def draft_pass_seconds(s: Setting) -> float:
    if s.drafter is None:
        return 0.0
    d = s.drafter
    return (d.weight_bytes_read + d.kv_bytes(s.draft_window)) / s.hw.gpu_bw + s.hw.draft_overhead


# ----------------------------------------------------------------------------------- per-token latency
@dataclass
class Prediction:
    """Seconds per token, with the parts that make them up (per verification for triforce)."""

    seconds_per_token: float
    parts: dict = field(default_factory=dict)

    @property
    def ms(self) -> float:
        return 1000 * self.seconds_per_token


def autoregressive(s: Setting, onchip: int | None = None) -> Prediction:
    """Autoregressive decoding with the KV cache offloaded (or on-chip when `s.offloaded` is False)."""
    if onchip is None:
        onchip = onchip_layers(replace(s, budget=1), with_drafter=False)  # no retrieval cache or drafter
    t = full_pass_seconds(s, onchip)
    return Prediction(t, {"full_pass": t, "onchip_layers": onchip})


def deepspeed_zero_inference(s: Setting) -> Prediction:
    """ZeRO-3 parameters offloaded (all weights cross PCIe each token) + KV offload with CPU attention."""
    hw, m = s.hw, s.model
    weights = m.weight_bytes / hw.pcie_bw
    attention = m.kv_bytes(s.context) / hw.host_bw
    return Prediction(weights + attention + hw.pass_overhead, {"weights_pcie": weights, "cpu_attention": attention})


def triforce(s: Setting, onchip: int | None = None) -> Prediction:
    e2 = tokens_per_verification(s.accept_middle, s.gamma2)
    e1 = tokens_per_verification(s.accept_draft, s.gamma1) if s.drafter is not None else 1.0
    middle_passes = s.gamma2 / e1  # each middle pass yields e1 tokens (accepted drafts + its own)
    draft_passes = middle_passes * s.gamma1 if s.drafter is not None else 0.0
    full = full_pass_seconds(s, onchip)
    middle = middle_passes * middle_pass_seconds(s)
    draft = draft_passes * draft_pass_seconds(s)
    per_verification = full + middle + draft
    return Prediction(per_verification / e2, {
        "full_pass": full, "middle": middle, "draft": draft, "tokens_per_verification": e2,
        "middle_passes": middle_passes, "draft_passes": draft_passes,
        "onchip_layers": onchip_layers(s) if onchip is None else onchip})


# ------------------------------------------------------------------------------ measured pass costs
def ms_per_token_from_passes(mode: str, ms: dict, accept: dict, gamma1: int, gamma2: int) -> float:
    """Milliseconds per token of `mode` from measured milliseconds per pass of each level (ms: draft,
    middle, verify; one figure per level, whatever the tokens fed) and acceptance rates (accept:
    draft->verify, draft->middle, middle->verify), by the arithmetic the adaptive generator
    chooses with (speculative.pricing.seconds_per_token; speculative runs gamma1 drafts per pass).

    A third level pays when its middle tokens, each costing about (gamma1 draft + middle) / E1 (the
    rounds as the host runs them: pricing.host_rounds), are cheap enough next to the full pass that
    the longer runs it buys (E2 over E of the drafter alone) win: triforce beats speculative exactly
    when this function says so for both."""
    gamma = gamma1 if mode == "speculative" else gamma2
    return seconds_per_token(mode, gamma, gamma1, lambda level, n: ms[level], lambda edge: accept[edge])


# ------------------------------------------------------------------------------ published calibration
@dataclass(frozen=True)
class PublishedRow:
    label: str
    system: str  # "triforce", "autoregressive", "deepspeed", "speedup"
    setting: Setting
    published_ms: float | None = None
    published_speedup: float | None = None
    onchip: int | None = None  # from the published command; None: computed from memory
    calibrates: bool = True  # False: shown, not used to fit or to test the tolerance
    note: str = ""


PREFILL = 130048
GEN = 256
CTX = PREFILL + GEN // 2  # the average KV length over the 256 generated tokens
TP2 = RTX4090.with_(tp=2)


def _row(label, system, model, hw, ms=None, budget=12288, gamma2=16, onchip=None, **kw):
    s = Setting(model, hw, CTX, budget=budget, gamma2=gamma2)
    return PublishedRow(label, system, s, published_ms=ms, onchip=onchip, **kw)


PUBLISHED = (
    _row("2x RTX 4090, TP=2", "triforce", LLAMA2_7B, TP2, 108, onchip=9),
    _row("2x RTX 4090, TP=2", "autoregressive", LLAMA2_7B, TP2, 840, onchip=12),
    _row("2x RTX 4090, TP=2", "triforce", LWM_7B, TP2, 114, onchip=9),
    _row("2x RTX 4090, TP=2", "autoregressive", LWM_7B, TP2, 840, onchip=12),
    _row("2x RTX 4090, TP=2", "triforce", LLAMA2_13B, TP2, 226),
    _row("2x RTX 4090, TP=2", "autoregressive", LLAMA2_13B, TP2, 1794),
    _row("1x RTX 4090", "triforce", LLAMA2_7B, RTX4090, 312, budget=8192, gamma2=12, onchip=0),
    _row("1x RTX 4090", "deepspeed", LLAMA2_7B, RTX4090, 1516,
         note="host_bw is fitted to this row: agreement by construction"),
    PublishedRow("1x A100, on-chip", "speedup",
                 Setting(LLAMA2_7B, A100_80G, 124928 + GEN // 2, budget=4096, gamma2=6, offloaded=False),
                 published_speedup=2.31, calibrates=False,
                 note="speedup only; budget 4096 has lower acceptance than 8-12K (not modelled)"),
)

# Constants fitted to the rows above (see calibrate()); the bandwidths are spec-sheet figures.
FITTED_ACCEPT_MIDDLE = 0.93
FITTED_ACCEPT_DRAFT = 0.6  # assumed, not fitted: the rows do not pin it down (middle passes are cheap)
CALIBRATION_TOLERANCE = 0.15  # every calibrating row's prediction within 15% of the published figure


def predict_row(row: PublishedRow, accept_middle: float | None = None, accept_draft: float | None = None,
                gamma1: int | None = None, gamma2: int | None = None, no_drafter: bool = False) -> Prediction:
    """The row's prediction; no_drafter: the middle level proposes on its own (our `retrieval` mode)."""
    s = replace(row.setting,
                accept_middle=FITTED_ACCEPT_MIDDLE if accept_middle is None else accept_middle,
                accept_draft=FITTED_ACCEPT_DRAFT if accept_draft is None else accept_draft,
                gamma1=row.setting.gamma1 if gamma1 is None else gamma1,
                gamma2=row.setting.gamma2 if gamma2 is None else gamma2)
    if no_drafter:
        s = replace(s, drafter=None)
    if row.system == "triforce":
        return triforce(s, row.onchip)
    if row.system == "autoregressive":
        return autoregressive(s, row.onchip)
    if row.system == "deepspeed":
        return deepspeed_zero_inference(s)
    if row.system == "speedup":  # on-chip: autoregressive / triforce
        base, tri = autoregressive(s), triforce(s)
        return Prediction(tri.seconds_per_token, {**tri.parts, "speedup": base.seconds_per_token / tri.seconds_per_token,
                                                  "baseline": base.seconds_per_token})
    raise ValueError(f"unknown system {row.system}")


def relative_error(row: PublishedRow, pred: Prediction) -> float:
    if row.published_ms is not None:
        return pred.ms / row.published_ms - 1
    return pred.parts["speedup"] / row.published_speedup - 1


def implied_acceptance(row: PublishedRow, accept_draft: float | None = None) -> float | None:
    """The middle acceptance at which the model reproduces the published figure (bisection), or None
    when the figure is out of reach (or the row has no acceptance)."""
    if row.system not in ("triforce", "speedup"):
        return None

    def err(a):
        return relative_error(row, predict_row(row, accept_middle=a, accept_draft=accept_draft))

    lo, hi = 0.0, 0.999999
    sign = 1 if row.system == "triforce" else -1  # latency falls with a; speedup rises with a
    if sign * err(lo) < 0 or sign * err(hi) > 0:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        if sign * err(mid) > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def calibrate(rows=PUBLISHED, grid=None) -> float:
    """The one middle acceptance that best fits the calibrating TriForce rows (least squares on log
    latency ratios). FITTED_ACCEPT_MIDDLE holds its rounded value."""
    grid = grid or [i / 1000 for i in range(500, 1000)]
    rows = [r for r in rows if r.calibrates and r.system == "triforce"]

    def loss(a):
        return sum(math.log(predict_row(r, accept_middle=a).ms / r.published_ms) ** 2 for r in rows)

    return min(grid, key=loss)


def calibration_table(rows=PUBLISHED) -> list[dict]:
    out = []
    for r in rows:
        pred = predict_row(r)
        out.append({
            "setting": r.label, "model": r.setting.model.name, "system": r.system,
            "budget": r.setting.budget if r.system in ("triforce", "speedup") else None,
            "gamma2": r.setting.gamma2 if r.system in ("triforce", "speedup") else None,
            "onchip_layers": pred.parts.get("onchip_layers"),
            "published_ms": r.published_ms, "predicted_ms": pred.ms,
            "published_speedup": r.published_speedup, "predicted_speedup": pred.parts.get("speedup"),
            "relative_error": relative_error(r, pred), "implied_accept_middle": implied_acceptance(r),
            "calibrates": r.calibrates, "note": r.note,
        })
    return out


def project_measured(accept_middle: float, accept_draft: float | None, gamma1: int | None = None,
                     gamma2: int | None = None, rows=PUBLISHED) -> list[dict]:
    """The published settings re-predicted with acceptance rates measured elsewhere (per-token rates,
    assumed independent of gamma). accept_draft None: no drafter level (our retrieval mode), the middle
    level proposes every token itself."""
    out = []
    for r in rows:
        if r.system not in ("triforce", "speedup"):
            continue
        pred = predict_row(r, accept_middle=accept_middle, accept_draft=accept_draft, gamma1=gamma1, gamma2=gamma2,
                           no_drafter=accept_draft is None)
        base = next((b for b in rows if b.label == r.label and b.setting.model == r.setting.model
                     and b.system in ("autoregressive", "deepspeed")), None)
        base_ms = predict_row(base).ms if base else pred.parts.get("baseline", 0) * 1000 or None
        out.append({"setting": r.label, "model": r.setting.model.name, "published_ms": r.published_ms,
                    "projected_ms": pred.ms, "projected_baseline_ms": base_ms,
                    "baseline": base.system if base else "autoregressive (on-chip)",
                    "projected_speedup": base_ms / pred.ms if base_ms else None,
                    "tokens_per_verification": pred.parts["tokens_per_verification"],
                    "gamma2": gamma2 or r.setting.gamma2})
    return out
