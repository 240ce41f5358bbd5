"""Rotary position embeddings with the scalings long-context checkpoints use.

Supported `rope_type`s: default, linear (position interpolation), dynamic (NTK), yarn, llama3.
Frequencies are fixed for a run: "dynamic" NTK is evaluated once at the run's maximum length,
because a static KV cache holds keys rotated once; re-rotating them as the sequence grows would
change the cached keys under the model's feet.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .config import ModelConfig
from .errors import UserError


def _yarn(inv_freq: torch.Tensor, base: float, dim: int, s: dict) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    original = int(s.get("original_max_position_embeddings") or 0)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension whose wavelength makes `rotations` turns over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 for high frequencies (kept), 0 for low ones (interpolated)
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inv_freq, float(attention_factor)


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low_f, high_f = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    original = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low_f, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_f) / (high_f - low_f)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high_f) & (wavelen <= original / low_f)
    return torch.where(medium, smoothed, scaled)


def rope_frequencies(cfg: ModelConfig, max_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2, float32) and the factor applied to cos/sin (YaRN's mscale)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    s = dict(cfg.rope_scaling or {})
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "dynamic":  # NTK: a larger base, evaluated once at the run's longest sequence
        seq_len = max(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        factor = float(s["factor"])
        base = base * ((factor * seq_len / cfg.max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(s["factor"]), 1.0
    if kind == "yarn":
        s.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
        return _yarn(inv_freq, base, dim, s)
    if kind == "llama3":
        return _llama3(inv_freq, s), 1.0
    raise UserError(f"unsupported RoPE scaling '{kind}': use linear, dynamic, yarn or llama3")


# positions a run's table covers past its length: proposals of the middle level and lookups run a
# few tokens past the last one a run keeps (a sampled adaptive run with compiled passes at 1,032
# tokens reached past them, grew the table and handed a compiled pass the new one: session 33)
HEADROOM = 256


class Rotary:
    """cos/sin for positions, read from a table of every position's values, built once per device
    from numpy's float64 cos and sin of the float32 angles, rounded to float32.

    Why a table: torch's float32 cos on CPU goes through MKL's vector math, whose results depend on
    the buffer's alignment, so the same prompt's keys differed between two processes in about one
    run in five (SmolLM2 at 4K, greedy: the 12th token flipped between runs of one command); and a
    pass computes no transcendental functions at all. A position reads the same values in a prefill,
    a decode step and a verification pass, on any device, eager or compiled."""

    def __init__(self, cfg: ModelConfig, max_len: int | None = None):
        # on the CPU even inside a model built on meta (the loaders): values, not shapes; on meta
        # torch's refs would compute them, which import torch._dynamo (a second of every run's start)
        with torch.device("cpu"):
            self.inv_freq, self.scale = rope_frequencies(cfg, max_len)
        # the positions a table covers: the run's length and HEADROOM (the levels propose past the
        # last token the run keeps), else the checkpoint's; a CPU table grows when a position falls
        # past it (no device reads a position back to find out), and a compiled pass made over the
        # old table is made again (speculative/graphs.py reads `length`)
        self.length = max_len + HEADROOM if max_len else max(cfg.max_position_embeddings, 1)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._retired: list[tuple[torch.Tensor, torch.Tensor]] = []  # outgrown tables a graph may still read
        if max_len:  # built now, so that a compiled pass (which cannot build one) finds it
            with torch.device("cpu"):
                self._tables[torch.device("cpu")] = self._build(self.length)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each (T, D), for `apply_rotary`."""
        if torch.compiler.is_compiling() and positions.device not in self._tables:
            # a model never run eagerly: torch's cos and sin (a compiled graph cannot build the table)
            freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
            cos, sin = freqs.cos() * self.scale, freqs.sin() * self.scale
        else:
            try:
                cos, sin = (t.index_select(0, positions) for t in self._table(positions.device))
            except (IndexError, RuntimeError):  # past a CPU table's end (a device's is the run's length)
                if positions.device.type != "cpu" or torch.compiler.is_compiling():
                    raise
                self.length = max(2 * self.length, int(positions.max()) + 1)
                self._tables.clear()
                cos, sin = (t.index_select(0, positions) for t in self._table(positions.device))
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def cover(self, positions: int) -> None:
        """Make the tables cover positions [0, positions) before any pass needs them. A device's table
        cannot grow inside a pass: on CUDA a position past it is a device-side assert, not the
        IndexError a CPU table grows on (the first H200 run of bench.big_target: a model built
        without headroom, and triforce's 81-token verification past its end). Tables made before
        are kept, not freed: a CUDA graph captured over one reads its address, and a position it
        covered has the same values in the larger table."""
        if positions <= self.length:
            return
        self.length = positions
        self._retired.extend(self._tables.values())
        self._tables = {torch.device("cpu"): self._build(self.length)}

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            cpu = self._tables.get(torch.device("cpu"))
            if cpu is None or cpu[0].shape[0] < self.length:
                cpu = self._tables[torch.device("cpu")] = self._build(self.length)
            self._tables[device] = tuple(t.to(device) for t in cpu)
        return self._tables[device]

    def shift(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """Rotate already-rotated vectors (T, H, D) by `delta` positions: a pure rotation, no mscale.
        The angles of -delta are those of delta negated (exactly), so cos is the same, sin negated."""
        freqs = torch.full((1,), float(abs(delta)), device=x.device)[:, None] * self.inv_freq.to(x.device)[None, :]
        # on a GPU torch's own (no MKL there, and no host-to-device copy inside a device round)
        if x.device.type == "cpu":
            from triforce.speculative.hostsync import on_the_host

            with on_the_host():  # numpy over a CPU tensor, on the CPU path alone: nothing waits
                cos, sin = _cos_sin_of(freqs)
        else:
            cos, sin = freqs.cos(), freqs.sin()
        sin = -sin if delta < 0 else sin
        return apply_rotary(x, torch.cat((cos, cos), dim=-1).to(x.dtype), torch.cat((-sin, sin), dim=-1).to(x.dtype))

    def _build(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions 0..length-1, each (length, D / 2) float32 on the CPU, times the
        scaling's factor (YaRN's mscale)."""
        freqs = torch.arange(length, dtype=torch.float32, device="cpu")[:, None] * self.inv_freq.cpu()[None, :]
        return tuple(t * self.scale for t in _cos_sin_of(freqs))


def _cos_sin_of(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of float32 angles (CPU), by numpy in float64 rounded to float32: the same bits
    whatever the buffer's alignment or the threads (no MKL)."""
    angles = freqs.double().numpy()
    return (torch.from_numpy(np.cos(angles).astype(np.float32)),
            torch.from_numpy(np.sin(angles).astype(np.float32)))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos, signed_sin: (T, D) or (1, D) from `Rotary.cos_sin`. The half-split rotation
    of Llama checkpoints, x cos + (-x2, x1) sin, with the minus folded into signed_sin (exact: a
    negation never rounds), so a call is four kernels, and a layer makes one call for q and k
    together. Products and sum stay separate ops, each rounded as the reference implementation
    rounds them: a fused multiply-add would round once and flip bf16 near-ties against it."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + swapped * signed_sin[:, None, :]


# ---------------------------------------------------------------------- scaling for a run's length
AUTO_MAX_FACTOR = 32  # YaRN beyond 32x the trained positions is untested territory: refuse instead


def max_auto_positions(cfg: ModelConfig) -> int:
    """The longest sequence `--rope-scaling auto` accepts for this checkpoint."""
    return max(cfg.max_positions, cfg.trained_positions * AUTO_MAX_FACTOR)


def scaled_for(cfg: ModelConfig, needed: int, spec: str = "auto", new_tokens: int = 0) -> tuple[ModelConfig, str | None]:
    """The config with RoPE scaling `spec` applied for a sequence of `needed` tokens, and a one-line
    note when a scaling was added (None otherwise). The one rule for every front end and the API.

    spec: "auto" keeps the checkpoint's RoPE (its own long-context scaling included, when its config
    has one) while `needed` fits, else adds YaRN with the smallest sufficient factor in steps of 0.25;
    "none" refuses to extend; "yarn:F" / "linear:F" force a factor. `new_tokens` (part of `needed`)
    lets a refusal name the longest prompt (--context) that would work."""
    if spec == "none":
        if needed > cfg.max_positions:
            raise UserError(f"{needed} tokens exceed the model's {cfg.max_positions} positions and "
                            f"Settings.rope_scaling none refuses to extend; use Settings.rope_scaling auto or a smaller Settings.context")
        return cfg, None
    if spec == "auto":
        if needed <= cfg.max_positions:
            return cfg, None
        if needed > max_auto_positions(cfg):
            raise UserError(f"{needed:,} tokens exceed the {max_auto_positions(cfg):,} positions automatic RoPE "
                            f"scaling supports for this model ({AUTO_MAX_FACTOR}x its {cfg.trained_positions:,} "
                            f"trained); use Settings.context {max_auto_positions(cfg) - new_tokens} or less")
        factor = math.ceil(needed / cfg.trained_positions * 4) / 4
        scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": cfg.trained_positions}
        note = (f"{needed:,} tokens exceed the {cfg.trained_positions:,} trained positions: applying YaRN RoPE "
                f"scaling x{factor:g} (Settings.rope_scaling none refuses instead)")
        return cfg.with_rope_scaling(scaling), note
    kind, _, value = spec.partition(":")
    try:
        factor = float(value)
    except ValueError:
        factor = 0.0
    if kind not in ("yarn", "linear") or factor < 1:
        raise UserError(f"Settings.rope_scaling '{spec}' not understood: use auto, none, yarn:F or linear:F with F >= 1")
    scaling = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = cfg.trained_positions
    scaled = cfg.with_rope_scaling(scaling)
    if needed > scaled.max_positions:
        raise UserError(f"{needed:,} tokens exceed the {scaled.max_positions:,} positions of {spec}; raise the factor "
                        f"(at least {math.ceil(needed / cfg.trained_positions * 4) / 4:g})")
    return scaled, None
