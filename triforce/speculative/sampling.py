"""Turning logits into the distribution a level samples from, and speculative verification.

The distribution of a level is softmax(logits / temperature) restricted by top-k and top-p and
renormalised; greedy (temperature 0) is handled without distributions, by argmax. The nucleus
(top-p) keeps a token when the mass of the tokens more probable than it is below top_p; tokens of
equal probability are kept or dropped together, so the set does not depend on how a sort orders
ties. Verification
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
            probs = nucleus(probs, self.top_p)
        return probs


NUCLEUS_CANDIDATES = 256  # the CPU's first guess at a nucleus's size; 4x more each time it falls short


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(N, V) distributions restricted to their nucleus and renormalised. On a GPU (and inside a
    compiled graph) from a full descending sort. Eager on a CPU that sort was the largest cost of a
    sampled token (SmolLM2's 49,152 ids: 3.4 ms a row against an 11.7 ms step), so the nucleus is
    sought among the NUCLEUS_CANDIDATES most probable ids by topk (0.1 ms), 4x more while some row's
    nucleus reaches past them, the whole sort past a quarter of the vocabulary: the same set, since
    the mass above a token is summed over the tokens before it in the same order (torch's CPU cumsum
    runs in sequence) and ties are kept together. SmolLM2 at temperature 1, top-p 0.9: nuclei of 63
    ids (median) to 1,012."""
    vocab = probs.shape[-1]
    k = min(NUCLEUS_CANDIDATES, vocab) if probs.device.type == "cpu" and not torch.compiler.is_compiling() else vocab
    while True:
        top = (torch.topk(probs, k, dim=-1) if k < vocab else torch.sort(probs, dim=-1, descending=True)).values
        keep = kept_prefix(top, top_p)
        if k == vocab:
            break
        from .hostsync import on_the_host

        with on_the_host():  # a CPU tensor, on the CPU path alone: nothing waits, on any device
            if not bool(keep[..., -1].any()):
                break
        k = 4 * k if 16 * k <= vocab else vocab
    smallest = top.gather(-1, keep.sum(dim=-1, keepdim=True) - 1)  # keep is a prefix of at least one
    kept = torch.where(probs >= smallest, probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def kept_prefix(top: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of the descending probabilities `top` (N, k) the nucleus keeps: those whose mass strictly
    above (the sum of those before the first of their ties) is below top_p."""
    before = top.cumsum(dim=-1) - top
    positions = torch.arange(top.shape[-1], device=top.device).expand_as(top)
    first = torch.ones_like(top, dtype=torch.bool)
    first[..., 1:] = top[..., 1:] != top[..., :-1]
    tie_start = torch.where(first, positions, 0).cummax(dim=-1).values
    return before.gather(-1, tie_start) < top_p


def draw_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of (N, V) distributions by inversion: the first token whose cumulative
    mass exceeds u * total, for uniforms (N,) in [0, 1). Runs on the distributions' device (no host
    read); a token of zero mass is never returned, even when rounding puts u * total at the top."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (uniforms.to(torch.float64) * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    last_with_mass = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(index, last_with_mass)


def proposed(drafts: torch.Tensor, limit: torch.Tensor | None) -> torch.Tensor | bool:
    """Which drafts are proposals: all, or the first `limit` (a device count) when a proposer made
    fewer than the positions verified (rounds.DeviceRoundProposer)."""
    return True if limit is None else torch.arange(drafts.shape[0], device=drafts.device) < limit


def verify_greedy(drafts: torch.Tensor, target_argmax: torch.Tensor,
                  limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted count, next token) as 0-dim device tensors: accept while the target's argmax
    agrees (the first mismatch, or the limit), then the target's argmax there."""
    agree = ((drafts == target_argmax[:drafts.shape[0]]) & proposed(drafts, limit)).long()
    accepted = agree.cumprod(dim=0).sum()
    return accepted, target_argmax.gather(0, accepted[None])[0]


def verify_sampled(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   uniforms: torch.Tensor, residual=None, limit: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over g drafts, on the device, as 0-dim tensors (accepted n, next token).

    draft_probs: (g, V) the distributions the drafts were drawn from; target_probs: (g + 1, V);
    uniforms: (g + 1,) float64 in [0, 1): draft i stands while u_i * q(x_i) < p(x_i), and u_g draws
    the next token, from norm(max(0, p - q)) at the first rejection or from target_probs[g] when all
    are accepted (a zero q row there makes the residual p itself). u_g is independent of the
    acceptance uniforms, so the draw has the law of a fresh one.
    With `limit` (a device count) only the first `limit` drafts are proposals: acceptance stops there
    and the next token is drawn from target_probs[limit], as if the proposal had ended. Exact as long
    as whether position i is proposed depends only on what came before it (a stopping time).
    `residual` exists so a test can substitute a wrong rule and see the checks fail.
    """
    residual = residual or residual_distribution
    g = drafts.shape[0]
    rows = torch.arange(g, device=drafts.device)
    p = target_probs[rows, drafts].to(torch.float64)
    q = draft_probs[rows, drafts].to(torch.float64) if g else p
    accepted = ((uniforms[:g] * q < p) & proposed(drafts, limit)).long().cumprod(dim=0).sum()  # u < p/q, no division
    no_draft = torch.zeros_like(target_probs[:1])
    q_rows = torch.cat((draft_probs.to(target_probs.dtype), no_draft)) if g else no_draft
    q_next = q_rows.index_select(0, accepted[None])[0]
    if limit is not None:
        q_next = at_the_cap(q_next, accepted, limit)
    dist = residual(target_probs.index_select(0, accepted[None])[0], q_next)
    return accepted, draw_rows(dist[None], uniforms[g:g + 1])[0]


def at_the_cap(q_next: torch.Tensor, accepted: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """The draft row the next token corrects for: none once acceptance reached the last proposal
    (the rows past it are a round's rejected drafts), so the draw is from the target itself."""
    return torch.where(accepted < limit, q_next, 0.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0)
    total = r.sum()
    return torch.where(total > 0, r / total, p)  # total 0 only by rounding when p == q: then p is exact
