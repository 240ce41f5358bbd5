"""Turning logits into the distribution a level samples from, and speculative verification.

The distribution of a level is softmax(logits / temperature) restricted by top-k and top-p and
renormalised; greedy (temperature 0) is handled without distributions, by argmax. Verification
follows speculative sampling exactly: accept draft x with probability min(1, p(x) / q(x)); on
rejection sample from norm(max(0, p - q)); when every draft is accepted sample a bonus from p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampler:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, V) logits -> (N, V) probabilities of this sampler's distribution."""
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logits = logits.to(dtype) / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)  # keep the nucleus
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a (V,) distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_greedy(drafts: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """(accepted count, next token): accept while the target's argmax agrees."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def verify_sampled(drafts: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator, residual=None) -> tuple[int, int]:
    """Speculative sampling over g drafts.

    draft_probs: (g, V) the distributions the drafts were drawn from; target_probs: (g + 1, V).
    Returns (accepted count n, next token): drafts[:n] stand, then the next token is a residual
    sample (on rejection) or a bonus sample from target_probs[g] (all accepted).
    `residual` exists so a test can substitute a wrong rule and see the checks fail.
    """
    residual = residual or residual_distribution
    uniforms = torch.rand(len(drafts), generator=generator, dtype=torch.float64)
    for i, x in enumerate(drafts):
        p, q = float(target_probs[i, x]), float(draft_probs[i, x])
        if uniforms[i] * q < p:  # u < p/q without dividing by a possibly zero q
            continue
        return i, draw(residual(target_probs[i], draft_probs[i]), generator)
    return len(drafts), draw(target_probs[len(drafts)], generator)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p  # total 0 only by rounding when p == q: then p is exact
