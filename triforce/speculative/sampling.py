"""Turning logits into the distribution a level samples from, and speculative verification.

The distribution of a level is softmax(logits / temperature) restricted by top-k and top-p and
renormalised; greedy (temperature 0) is handled without distributions, by argmax. The nucleus
(top-p) keeps a token when the mass of the tokens more probable than it is below top_p; tokens of
equal probability are kept or dropped together, so the set does not depend on how a sort orders
ties.

Verification is exact in two forms. Token by token (speculative sampling): accept draft x with
probability min(1, p(x) / q(x)); on rejection sample from norm(max(0, p - q)); when every draft is
accepted sample a bonus from p. By block (the default; Sun et al., "Block Verification Accelerates
Speculative Decoding", ICLR 2025): the drafts are judged together, so a draft the target likes more
than the drafter did can carry an earlier one the target liked less. It never accepts fewer tokens in
expectation, and accepts more wherever drafts are sampled; see verify_block for the rule.
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


VERIFICATION_RULES = ("block", "token")


def verify_sampled(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   uniforms: torch.Tensor, residual=None, limit: torch.Tensor | None = None,
                   rule: str = "block") -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted n, next token) as 0-dim device tensors by `rule`: "block" (verify_block) or
    "token" (verify_tokens); both take the same arguments and the same g + 1 uniforms."""
    verify = verify_block if rule == "block" else verify_tokens
    return verify(drafts, draft_probs, target_probs, uniforms, residual=residual, limit=limit)


def verify_tokens(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
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
    row = target_probs.index_select(0, accepted[None])[0]
    dist = residual(row, draft_row(draft_probs, accepted, g if limit is None else limit, row))
    return accepted, draw_rows(dist[None], uniforms[g:g + 1])[0]


def draft_row(draft_probs: torch.Tensor, accepted: torch.Tensor, last, like: torch.Tensor) -> torch.Tensor:
    """The drafter's distribution the next token corrects for: row `accepted`, or none (zeros) once
    all `last` proposals stood, when the next token comes from the target itself."""
    g = draft_probs.shape[0]
    if g == 0:
        return torch.zeros_like(like)
    row = draft_probs.index_select(0, accepted.clamp_max(g - 1)[None])[0].to(like.dtype)
    return at_the_cap(row, accepted, last)


def verify_block(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 uniforms: torch.Tensor, residual=None, limit: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification over g drafts (arguments and result as verify_tokens), on the device.

    With r_i = p(x_i) / q(x_i), the weight w_i = min(w_{i-1} r_i, 1), w_0 = 1, is the chance that
    the first i drafts stand; it stays high after a draft the target liked less (r < 1) when a later
    one it liked more (r > 1) makes up for it. Stopping after i < L drafts (L: g, or `limit`) has
    weight m_i = sum_x max(w_i p_{i+1}(x) - q_{i+1}(x), 0); we stop at the largest i whose uniform
    u_{i-1} falls below h_i = m_i / (m_i + 1 - w_i), with h_L = w_L, and at 0 when none does; the
    next token comes from norm(max(w_i p_{i+1} - q_{i+1}, 0)), or from p_{L+1} after all L.

    Exact, by induction over the drafts from the last: given the first i drafts, the chance of
    standing at i or beyond is w_i (sum over x of q(x) min(w_i p(x) / q(x), 1) = w_i - m_i, plus
    (1 - w_i + m_i) h_i = m_i). So after i drafts the next token is y with chance
    q(x<=i) (min(w_i p(y), q(y)) + max(w_i p(y) - q(y), 0)) = q(x<=i) w_i p(y): the target's
    next-token law times the chance of having got there, which is the exactness of every prefix.
    The induction only asks that whether position i + 1 is proposed depend on the drafts before it,
    so it holds for any `limit` that is a stopping time, as verify_tokens does. Drafted from point
    masses (lookups), it accepts what verify_tokens accepts, in law.
    """
    residual = residual or residual_distribution
    g = drafts.shape[0]
    if g <= 1:  # one draft: the same rule (h_1 = w_1 = min(1, p/q)), in fewer kernels
        return verify_tokens(drafts, draft_probs, target_probs, uniforms, residual=residual, limit=limit)
    positions, last, w, mass, den = block_terms(drafts, draft_probs, target_probs, limit)
    eta = uniforms[:g].to(torch.float64)
    stops = torch.where(positions == last, eta < w[1:], eta * den < mass) & (positions <= last)
    accepted = (stops * positions).max()  # the largest stop, 0 when none
    row = w.index_select(0, accepted[None]).to(target_probs.dtype) * target_probs.index_select(0, accepted[None])[0]
    dist = residual(row, draft_row(draft_probs, accepted, last[0], row))
    return accepted, draw_rows(dist[None], uniforms[g:g + 1])[0]


def block_terms(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                limit: torch.Tensor | None):
    """verify_block's terms for g >= 1 drafts: positions 1..g, the last proposed L (1,), the weights
    w_0..w_g, and h_i = mass_i / den_i for i = 1..g (meaningful below L; at L, h is w_L)."""
    g = drafts.shape[0]
    positions = torch.arange(1, g + 1, device=drafts.device)
    last = positions[-1:] if limit is None else limit.reshape(1)
    p = target_probs[positions - 1, drafts].to(torch.float64)
    q = draft_probs[positions - 1, drafts].to(torch.float64)
    # w_i = min(w_{i-1} r_i, 1) in logs: the running sum of log r minus its running maximum above 0
    log_ratio = torch.where(positions <= last, p.log() - q.log(), 0.0)
    running = log_ratio.cumsum(dim=0)
    w = torch.cat((torch.ones_like(running[:1]), (running - running.cummax(dim=0).values.clamp_min(0)).exp()))
    # m_0 .. m_{g-1} in the distributions' dtype, in place: (g, V) float64 temporaries cost a CPU 6-15 ms
    rest = target_probs[:g] * w[:g, None].to(target_probs.dtype)
    stop_mass = rest.sub_(draft_probs.to(rest.dtype)).clamp_min_(0).sum(dim=-1, dtype=torch.float64)
    mass = torch.cat((stop_mass[1:], stop_mass[:1]))  # m_1 .. m_{g-1}, and a placeholder at g
    return positions, last, w, mass, mass + 1 - w[1:]


def at_the_cap(q_next: torch.Tensor, accepted: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """The draft row the next token corrects for: none once acceptance reached the last proposal
    (the rows past it are a round's rejected drafts), so the draw is from the target itself."""
    return torch.where(accepted < limit, q_next, 0.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp_min(0)
    total = r.sum()
    return torch.where(total > 0, r / total, p)  # total 0 only by rounding when p == q: then p is exact
