"""Which chunks should the middle level's retrieval cache hold? Acceptance under other selection rules.

    python -m bench.retrieval_rules                   # SmolLM2, 7,936 tokens of Persuasion at 3 places
    python -m bench.retrieval_rules --books ../shared/data/books/persuasion.txt,../shared/data/books/prideprejudice.txt

TriForce scored each chunk of `chunk` tokens by its mean key against the last token's query, per layer
and KV head, and kept the best within the budget beside the sink chunk and the last two chunks; the
engine (speculative/retrieval.py) now holds half the budget for the latest tokens and ranks the
chunks by the query's exact attention ("mass + recent half" here). The better the middle level's distributions match the full cache's, the
more tokens each full-cache pass accepts, so the rule is a lever on every mode with a retrieval level.

Teacher-forced, so every rule sees the same text: for each window of a book (`--context` tokens, then
`--continuation` more), the full cache prefills the context and runs the continuation; a retrieval
cache is built from the context by each rule (RetrievalCache's own build and selection, only the
scores differ) and runs the same continuation. At each continuation position, against the full
cache's distribution:

    greedy      the argmax agrees (what greedy verification accepts)
    accept T=1  sum over tokens of min(p, q), at temperature 1: the chance a sampled draft stands
    accept 0.6  the same at temperature 0.6, top-p 0.9 (the published setting)

One difference from a generation: the middle level here keeps its own K/V of the continuation, where
the engine copies in the full cache's K/V of committed tokens. Writes results/retrieval_rules-<time>.json.

A book is its story (bench/prompts.py: Project Gutenberg's header and licence cut), and a context
past the model's trained positions gets the RoPE scaling a run of that length gets (session 55;
before, the bench ran such a context unscaled). The "+ summaries" rules (session 55) attend, beside
the engine's slots, a first-order summary of every 32 or 8 positions the budget leaves out
(group_summaries): a measured no (docs/results/2026-11-29-cpu-gutenberg-files-and-lease-calls.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.prompts import story_text
from triforce.model.config import ModelConfig
from triforce.model.loader import load_model, load_tokenizer
from triforce.runtime.settings import resolve_rope
from triforce.speculative.caches import FullCache
from triforce.speculative.retrieval import RetrievalCache, attention_mass, plan_selection
from triforce.speculative.sampling import Sampler

DEFAULT_MODEL = "models/smollm2-135m"
DEFAULT_BOOK = Path(__file__).resolve().parent.parent / "triforce" / "data" / "persuasion.txt"
PIECE = 1024  # prefill piece: the model's attention over a whole 8K prompt at once would hold 8K x 8K scores
SAMPLERS = {"accept T=1": Sampler(1.0), "accept 0.6": Sampler(0.6, top_p=0.9)}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def mean_key_scores(query: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """TriForce's rule, (Hkv, C): each chunk's mean key (Hkv, C, D) against the query (Hq, D), a softmax
    over the chunks per query head, summed over the query heads sharing a KV head."""
    Hkv, _, D = means.shape
    logits = query.float().view(Hkv, -1, D) @ means.float().transpose(1, 2) * D ** -0.5
    return logits.softmax(dim=-1).sum(dim=1)


def rule(name: str, scores: str, recent_share: float = 0.0, queries: int = 1) -> type:
    """A retrieval cache scoring chunks by `scores` over the last `queries` queries (the bench's queries
    are (16, Hq, D) per layer), with `recent_share` of the budget held for the latest tokens."""
    def chunk_scores(self, full, layer, query, n_chunks):
        if scores == "recent":
            return torch.arange(n_chunks, dtype=torch.float32).expand(self.shape.num_kv_heads, n_chunks)
        if scores == "mean key":
            return mean_key_scores(query[-1], full.chunk_key_means(layer, self.chunk, n_chunks))
        return attention_mass(full, layer, query[-queries:], n_chunks, self.chunk)
    return type(name, (RetrievalCache,), {"chunk_scores": chunk_scores, "RECENT_SHARE": recent_share})


def group_summaries(keys: torch.Tensor, values: torch.Tensor, free: torch.Tensor, query: torch.Tensor,
                    group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summaries of the positions a cache does not hold, `group` at a time, per query head: for the
    build query q0 (Hq, D), each group's log-mass lse = logsumexp_i(q0.k_i s) over its free positions,
    and its keys and values weighted by that softmax (k*, v*). A later query q scores the group
    q.k* s + (lse - q0.k* s): the first-order expansion of the group's log-mass around q0, exact at q0.
    keys, values (Hkv, G * group, D); free (Hkv, G * group) bool. Returns k*, v* (Hq, G, D) and the
    bias (Hq, G), -inf for a group with no free position."""
    Hkv, n, D = keys.shape
    Hq, scale = query.shape[0], D ** -0.5
    per_kv = Hq // Hkv

    def by_head(x: torch.Tensor) -> torch.Tensor:  # (Hkv, n, ...) -> (Hq, G, group, ...), query heads grouped
        return x.repeat_interleave(per_kv, 0).view(Hq, n // group, group, *x.shape[2:])

    k, v, f = by_head(keys.double()), by_head(values.double()), by_head(free)
    q0 = query.double()
    logits = torch.einsum("hd,hgsd->hgs", q0, k).mul(scale).masked_fill(~f, -float("inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    k_star, v_star = torch.einsum("hgs,hgsd->hgd", weights, k), torch.einsum("hgs,hgsd->hgd", weights, v)
    bias = (lse - torch.einsum("hd,hgd->hg", q0, k_star) * scale).masked_fill(~f.any(-1), -float("inf"))
    return k_star, v_star, bias


def summarized(base: type, group: int) -> type:
    """`base`'s cache plus a summary (group_summaries) of every `group` positions it does not hold,
    attended beside its slots: does the mass the budget leaves out carry what the middle level lacks?
    Eager float64 attention of the bench's own (never the engine's kernels): group 1 is the full cache."""
    class Summarized(base):
        def build(self, full, n_tokens, queries):
            super().build(full, n_tokens, queries)
            n = n_tokens // group * group
            self.summaries = []
            for layer in range(self.shape.num_layers):
                scores = self.chunk_scores(full, layer, queries[layer], n_tokens // self.chunk)
                index, _, _ = plan_selection(n_tokens, self.budget, self.chunk, scores, int(self.budget * self.RECENT_SHARE))
                free = torch.ones(index.shape[0], n_tokens, dtype=torch.bool).scatter_(1, index, False)[:, :n]
                keys, values = full.read(layer, 0, n)
                query = queries[layer][-1] if queries[layer].dim() == 3 else queries[layer]
                self.summaries.append(group_summaries(keys, values, free, query, group))

        def run_stack(self, stack, x, cos, sin):
            return None  # every layer through attend below

        def attend(self, layer, q, k, v):
            T, Hq, D = q.shape
            self.k[layer, :, self.used:self.used + T] = k.transpose(0, 1)
            self.v[layer, :, self.used:self.used + T] = v.transpose(0, 1)
            keys = self.k[layer, :, :self.used + T].double().repeat_interleave(Hq // k.shape[1], 0)
            values = self.v[layer, :, :self.used + T].double().repeat_interleave(Hq // k.shape[1], 0)
            k_star, v_star, bias = self.summaries[layer]
            qd, S = q.double().transpose(0, 1), keys.shape[1]  # (Hq, T, D)
            slots = (qd @ keys.transpose(1, 2) * D ** -0.5).masked_fill(
                ~torch.ones(T, S, dtype=torch.bool).tril(S - T), -float("inf"))
            groups = qd @ k_star.transpose(1, 2) * D ** -0.5 + bias[:, None]
            weights = torch.cat((groups, slots), dim=-1).softmax(-1)
            out = weights[..., :groups.shape[-1]] @ v_star + weights[..., groups.shape[-1]:] @ values
            return out.transpose(0, 1).reshape(T, Hq * D).to(q.dtype)

    return type(f"{base.__name__}, summaries of {group}", (Summarized,), {})


RULES = {name: rule(name, *how) for name, how in {
    "mean key (TriForce's)": ("mean key",),
    "recent only": ("recent",),
    "attention mass": ("mass",),
    "mean key + recent quarter": ("mean key", 0.25),
    "mean key + recent half": ("mean key", 0.5),
    "mass + recent quarter": ("mass", 0.25),
    "mass + recent half": ("mass", 0.5),
    "mass, 16 queries + recent half": ("mass", 0.5, 16),
}.items()}
RULES |= {f"mass + recent half + summaries of {g}": summarized(RULES["mass + recent half"], g) for g in (32, 8)}


def full_logits(model, ids: torch.Tensor, context: int) -> tuple[FullCache, torch.Tensor, list[torch.Tensor]]:
    """The full cache over ids; the logits predicting ids[context:]; each layer's queries of the
    context's last 16 tokens (k, Hq, D)."""
    full = FullCache(model.kv_shape(), len(ids))
    for start in range(0, context, PIECE):
        last = model(ids[start:min(start + PIECE, context)], full)[-1:]
    queries = [q[-16:].clone() for q in full.queries]
    rest = model(ids[context:-1], full)
    return full, torch.cat((last, rest)).double(), queries


def middle_logits(model, rule: type, full, ids, context, queries, budget, chunk) -> tuple[torch.Tensor, RetrievalCache]:
    """A retrieval cache built by `rule` from the first context - 1 tokens (as the engine builds after
    a prefill) and run over the continuation: the logits predicting ids[context:]."""
    cache = rule(model.kv_shape(), budget, chunk, scratch=len(ids) - context + 8)
    cache.build(full, context - 1, queries)
    return model(ids[context - 1:-1], cache).double(), cache


def agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict:
    row = {"greedy": (p_logits.argmax(-1) == q_logits.argmax(-1)).double().mean().item()}
    for name, sampler in SAMPLERS.items():
        row[name] = torch.minimum(sampler.probs(p_logits), sampler.probs(q_logits)).sum(-1).mean().item()
    return row


def windows(tokens: list[int], length: int, places=(0.2, 0.5, 0.8)):
    """Windows of `length` tokens starting at the given fractions of the text (fewer if it is short)."""
    last = len(tokens) - length
    if last < 0:
        raise SystemExit(f"a book of {len(tokens)} tokens is shorter than one window ({length}); lower --context")
    return sorted({int(last * f) for f in places})


def compare(model, books: dict[str, list[int]], context: int, continuation: int, budget: int, chunk: int,
            rules=RULES) -> list[dict]:
    rows = []
    with torch.inference_mode():
        for book, tokens in books.items():
            for start in windows(tokens, context + continuation):
                ids = torch.tensor(tokens[start:start + context + continuation])
                t0 = time.perf_counter()
                full, p_logits, queries = full_logits(model, ids, context)
                say(f"{book} at token {start:,}: full cache in {time.perf_counter() - t0:.1f} s")
                for name, rule in rules.items():
                    q_logits, _ = middle_logits(model, rule, full, ids, context, queries, budget, chunk)
                    rows.append({"book": book, "start": start, "rule": name} | agreement(p_logits, q_logits))
    return rows


def summary(rows: list[dict], gamma2: int) -> list[dict]:
    """Per rule, the mean over windows, and the tokens a full pass would accept at gamma2 drafts if
    each stood independently with the T=1 chance (a guide, not a measurement)."""
    out = []
    for rule in dict.fromkeys(r["rule"] for r in rows):
        mine = [r for r in rows if r["rule"] == rule]
        row = {"rule": rule} | {k: sum(r[k] for r in mine) / len(mine) for k in ("greedy", *SAMPLERS)}
        a = row["accept T=1"]
        row[f"tokens/pass g{gamma2}"] = (1 - a ** (gamma2 + 1)) / (1 - a) if a < 1 else gamma2 + 1.0
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k != "rule"]
    width = max(32, *(len(r["rule"]) + 2 for r in rows))
    lines = [f"{'rule':<{width}}" + "".join(f"{k:>15}" for k in keys), "-" * (width + 15 * len(keys))]
    lines += [f"{r['rule']:<{width}}" + "".join(f"{r[k]:>15.3f}" for k in keys) for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--books", default=str(DEFAULT_BOOK), help="comma-separated text files")
    p.add_argument("--context", type=int, default=7936)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--rules", default=",".join(RULES), help="comma-separated, of: " + ", ".join(RULES))
    p.add_argument("--gamma2", type=int, default=6, help="for the tokens-per-pass guide")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rules = {name: RULES.get(name) for name in args.rules.split(",") if name}
    if None in rules.values():
        p.error(f"unknown rule: {', '.join(n for n, r in rules.items() if r is None)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    # past the trained positions, the RoPE scaling a run of this length gets (YaRN, said on stderr)
    cfg = resolve_rope(ModelConfig.from_folder(args.model), args.context + args.continuation, "auto", say)
    model = load_model(args.model, torch.float32, "cpu", cfg=cfg, max_len=args.context + args.continuation)
    books = {Path(b).stem: tokenizer.encode(story_text(Path(b).read_text(encoding="utf-8")), add_special_tokens=False)
             for b in args.books.split(",") if b}
    rows = compare(model, books, args.context, args.continuation, args.budget, args.chunk, rules)
    means = summary(rows, args.gamma2)
    out = args.out or Path("results") / f"retrieval_rules-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "context": args.context, "continuation": args.continuation,
                               "budget": args.budget, "chunk": args.chunk, "threads": torch.get_num_threads(),
                               "windows": rows, "means": means}, indent=2) + "\n")
    print(table(means))
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
