"""CUDA graphs for every level whose cache is resident: the drafter step, the middle-level
verification, and the full-cache verification when the full cache is on the device.

The caches (StreamingLLM, retrieval, full) are preallocated buffers, but their own `attend` slices
by a Python length, which a graph would freeze at capture time. `StaticView` is the same model
protocol over the same buffers with shapes that never change: the new tokens' slots and positions
live in device tensors and attention spans the whole capacity under a mask, so one capture per
(cache, tokens per call, last_only) replays at any length. Cache bookkeeping (begin, which may
evict, and end) stays eager around the replay. For a full cache the view also keeps the rotated
queries in static buffers, which the retrieval level scores chunks with. An offloaded full cache's
pass is captured with its copies (offload/graphed.py: one graph per width and bucket of lengths).

    enable_cuda_graphs(generator)   # after constructing it

With `eager_static=True` the same view runs eagerly instead of being captured (any device): that
is how the CPU tests check that the graph path computes what the caches' own path does. With
`compiled=True` each (cache, tokens per call, last_only) pass over the view is one torch.compile'd
graph (fullgraph: a break would be an error, not a silent slowdown), run as is on CPU and captured
on CUDA: norm, RoPE and SiLU fused, the mask built once per pass.

    enable_compiled_passes(generator)   # --compile

Triforce's device rounds (rounds.py) go one step further under either call: each drafter->middle
round (gamma1 drafter passes, the middle level's pass, sampling and verification) is one graph,
rounds.RoundGraph, compiled or captured whole.
"""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch

from triforce.model import cpu_kernels, key_tiles
from triforce.model.attention import aligned_mask, attend_masked, attend_shared_heads
from triforce.model.eager_steps import watched

from triforce.offload.store import OffloadedCache

from .caches import FullCache
from .models import padded_width

MAX_GRAPH_TOKENS = 32  # calls feeding more tokens (prefill, rebuild catch-up) run eagerly
# Compiled (--compile), a pass width becomes a graph on its third call, eager until then: a level
# catching up on tokens it did not see (the adaptive chooser ran another mode meanwhile) feeds widths
# that may never recur, and compiling each (seconds) made `--compile` with a drafter 20x slower than
# eager. CUDA graphs alone capture at once (milliseconds).
HOT_AFTER = 3
# graphs this process made (CUDA captures and compiled pass widths): a benchmark reads it before and
# after its clock to tell whether a capture (tens of ms) or a compile (seconds) fell inside it
made = {"graphs": 0}


def pad_tokens(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """tokens followed by copies of the last, up to `width` (their outputs are dropped)."""
    extra = width - tokens.shape[0]
    return tokens if extra == 0 else torch.cat((tokens, tokens[-1:].expand(extra)))


class StaticView:
    """The model protocol over a SlotCache's K/V buffers, with static shapes."""

    compilable = True  # a pass over it traces whole (an offloaded view's copies and streams do not)

    def __init__(self, cache, T: int):
        self.cache, self.T = cache, T
        device = cache.k.device
        # a full cache hands the retrieval level its last queries: kept here, in buffers a graph can fill
        self.queries: list[torch.Tensor | None] | None = [None] * cache.shape.num_layers \
            if isinstance(cache, FullCache) else None
        self.positions = torch.zeros(T, dtype=torch.long, device=device)
        self.slots = torch.zeros(T, dtype=torch.long, device=device)
        self.offsets = torch.arange(T, device=device)
        self.key_slots = torch.arange(cache.capacity, device=device)
        # each layer's K/V as its own tensor (views of the cache's buffers, made once, outside any graph)
        self.layer_k, self.layer_v = list(cache.k.unbind(0)), list(cache.v.unbind(0))
        self.tiled = cache.tiled  # a full cache's keys in tiles, values in pairs (model/key_tiles.py)
        # additive (0 or -inf) in the attention's dtype, so no layer converts it either
        self.mask = aligned_mask(T, cache.capacity, cache.k.dtype, device)
        self.limits = torch.zeros(T, dtype=torch.long, device=device)  # the mask as counts: slots + 1

    def set(self, positions: torch.Tensor, start: int) -> None:
        """Point the view at this call's RoPE positions and the slots [start, start + T)."""
        self.positions.copy_(positions)
        torch.add(self.offsets, start, out=self.slots)

    def begin(self, T: int) -> torch.Tensor:
        # the causal mask, once per pass and inside the graph; every layer reads it. A query sees every
        # slot up to its own: earlier tokens, never later ones or stale slots
        self.mask.fill_(0).masked_fill_(self.key_slots[None, :] > self.slots[:, None], float("-inf"))
        torch.add(self.slots, 1, out=self.limits)
        return self.positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.queries is not None:
            if self.queries[layer] is None:  # allocated by the eager warm-up, before any capture
                self.queries[layer] = torch.empty_like(q)
            self.queries[layer].copy_(q)
        keys, values = self.layer_k[layer], self.layer_v[layer]  # (Hkv, capacity, D)
        if self.tiled:
            key_tiles.write(keys, self.slots, k.transpose(0, 1))
            key_tiles.write_values(values, self.slots, v.transpose(0, 1))
        else:
            keys.index_copy_(1, self.slots, k.transpose(0, 1).to(keys.dtype))  # a 16-bit cache under float32 compute
            values.index_copy_(1, self.slots, v.transpose(0, 1).to(values.dtype))
        if not q.is_cuda:  # torch's CPU SDPA with a mask is 20x the grouped products at one query
            # the cache as it is: the CPU kernels read 16-bit keys themselves, and attend_masked widens
            # only where none serves. Widening here wrote a float32 copy of every layer each pass
            # (compiled, SmolLM2 at 4K on avx2: 6 ms of a 15 ms token; 2x eager at 16K)
            return attend_masked(q, keys, values, self.mask.to(q.dtype), self.limits, self.tiled)
        return attend_shared_heads(q, keys.to(q.dtype), values.to(q.dtype), self.mask.to(q.dtype))

    def end(self, T: int) -> None:
        pass  # the real cache's end() runs eagerly after the replay


@dataclass
class _Captured:
    view: StaticView
    tokens: torch.Tensor
    logits: torch.Tensor | None = None
    graph: object = None
    forward: object = None  # the pass over the view: the model's, or its compiled graph
    positions: int = 0  # the RoPE table's length the compiled graph read (a table that grew is another input)


class GraphedModel:
    """Drop-in for a Level's model: small calls on CUDA replay a graph (or, with eager_static, run the
    static view eagerly on any device); everything else goes to the model unchanged."""

    def __init__(self, model, eager_static: bool = False, max_tokens: int = MAX_GRAPH_TOKENS, warmup: int = 2,
                 compiled: bool = False, options: dict | None = None, pad_widths: bool = False):
        self.model, self.max_tokens, self.warmup = model, max_tokens, warmup
        self.pad_widths = pad_widths  # a full cache's passes rounded up to WIDTHS (one graph a bucket)
        self.eager_static, self.compiled, self.options = eager_static, compiled, options
        self.captured: dict[tuple, _Captured] = {}
        self.views: dict[tuple, StaticView] = {}
        self.replays = 0
        self.captures = 0  # Level.run leaves a pass that captured (or compiled) out of the chooser's timings
        self.calls: dict[tuple, int] = {}  # per (cache, width, last_only): calls so far, until it is hot
        self.offload_failure: str | None = None  # why an offloaded pass could not be captured, once it could not

    def __getattr__(self, name):  # embed, rotary, kv_shape, ... of the wrapped model
        return getattr(self.__dict__["model"], name)

    def __call__(self, tokens: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        T = tokens.shape[0]
        graphs = tokens.is_cuda and not self.eager_static
        if T > self.max_tokens or not (graphs or self.eager_static) or watched(self.model):
            return self.model(tokens, cache, last_only)
        if isinstance(cache, OffloadedCache):
            # captured whole with its copies (offload/graphed.py), never compiled: under --compile a
            # CUDA pass is captured as it is and a CPU pass runs the cache's own eager path
            if (self.compiled and not graphs) or self.offload_failure is not None:
                return self.model(tokens, cache, last_only)
            from triforce.offload.graphed import graphed_pass

            try:
                return graphed_pass(self, tokens, cache, last_only)
            except RuntimeError as e:  # a CUDA build or driver that cannot capture the copies: eager from here on
                self.offload_failure = f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"warning: the offloaded cache's passes run eagerly: capturing one failed ({self.offload_failure})",
                      file=sys.stderr)
                return self.model(tokens, cache, last_only)
        width = self.width(T, cache, cache.capacity - cache.used, last_only)
        key = (id(cache), width, last_only)
        if self.compiled and key not in self.views:  # compiling costs seconds; capturing, milliseconds
            self.calls[key] = self.calls.get(key, 0) + 1
            if self.calls[key] < HOT_AFTER:
                return self.model(tokens, cache, last_only)
        positions = cache.begin(T)  # eager: may evict (StreamingLLM) before the slots are chosen
        if width > T:  # a full cache: the padded positions follow on, in slots no real query sees
            positions = torch.cat((positions, positions[-1:] + torch.arange(1, width - T + 1, device=positions.device)))
        view = self.view(key, lambda: StaticView(cache, width))
        view.set(positions, cache.used)
        logits = self.run_view(view, pad_tokens(tokens, width), last_only)
        if view.queries is not None:
            cache.queries = list(view.queries) if T == view.T else [q[:T] for q in view.queries]  # views either way
        cache.end(T)
        return logits[:T]

    def once(self, tokens: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """A pass whose width seldom recurs (a prompt's last piece, a chat turn, a drafter's window
        refill), run by the model itself: a capture costs a warm-up pass, the capture and a memory pool
        of the graph's own, kept for good, and a chat of short turns made one per new turn length."""
        return self.model(tokens, cache, last_only)

    def width(self, T: int, cache, room: int, last_only: bool) -> int:
        """The width a pass of T tokens runs at: T, or with pad_widths a full cache's verification
        rounded up to WIDTHS (room: the free slots after the pass's first)."""
        if not self.pad_widths or last_only or not isinstance(cache, (FullCache, OffloadedCache)):
            return T
        return padded_width(T, room)

    def view(self, key: tuple, make) -> StaticView:
        """The view kept under `key`, made by make() the first time."""
        if key not in self.views:
            self.views[key] = make()
        return self.views[key]

    def drop_views(self, stale) -> None:
        """Forget the views that stale(key, view) names, with their graphs (and the graphs' memory)."""
        for key in [k for k, v in self.views.items() if stale(k, v)]:
            view = self.views.pop(key)
            for last_only in (False, True):
                self.captured.pop((id(view), last_only), None)

    def run_view(self, view: StaticView, tokens: torch.Tensor, last_only: bool) -> torch.Tensor:
        """The pass over a view already pointed at its slots: a graph replay on CUDA, else the view's
        forward (compiled or eager). Device rounds (rounds.py) call this with their own views."""
        key = (id(view), last_only)
        c = self.captured.get(key)
        if c is None and self.compiled and view.queries is not None and any(q is None for q in view.queries):
            # one eager pass allocates the query buffers (and grows a CPU RoPE table as far as this
            # pass reads), so the graph traces them as inputs once; traced without them it compiled
            # twice, and on CUDA the second compile fell inside the capture, which CUDA refuses
            with torch.no_grad():
                self.model(pad_tokens(tokens, view.T), view, last_only)
        table = getattr(getattr(self.model, "rotary", None), "length", 0)
        if c is None or (c.positions != table and not tokens.is_cuda):  # a CPU table grew: compile anew
            c = self.captured[key] = _Captured(view, torch.zeros_like(tokens), positions=table)
            c.forward = self._forward(view, last_only)
            if self.compiled and not (tokens.is_cuda and not self.eager_static):
                self.captures += 1  # this call compiles: not a sample of the pass's cost
                made["graphs"] += 1
        c.tokens.copy_(tokens)
        if not tokens.is_cuda or self.eager_static:
            logits = c.forward(c.tokens)
        else:
            if c.graph is None:
                self._capture(c, last_only)
            c.graph.replay()
            logits = c.logits.clone()
        self.replays += 1
        return logits

    def _forward(self, view: StaticView, last_only: bool):
        model = self.model

        def forward(tokens):
            return model(tokens, view, last_only)
        return compile_static(forward, self.options) if self.compiled and view.compilable else forward

    def _capture(self, c: _Captured, last_only: bool) -> None:
        # the first capture warms the model up `warmup` times (cuBLAS and cuDNN handles, workspaces);
        # a later width needs one eager call, for its own kernels' plans. Each warm-up is an eager pass
        # (about 25 ms of launches at SmolLM2's size, 46 ms offloaded at 32K on the H200), paid again
        # for every new width: the adaptive default's first 64 tokens paid 5 captures (session 35)
        warmup = self.warmup if self.captures == 0 else 1
        self.captures += 1
        c.graph, c.logits = capture_graph(lambda: c.forward(c.tokens), [self.model], c.tokens.device, warmup)


# guards that stay: the process's state a graph was traced under (grad mode, default device, ...)
_STATE_GUARDS = ("GLOBAL_STATE", "SHAPE_ENV", "TORCH_FUNCTION_MODE_STACK", "DEFAULT_DEVICE")


def _guards_on_inputs(entries) -> list[bool]:
    """dynamo's guard filter for compile_static: keep the state guards and those on the function's own
    arguments and closure (the view's buffers, last_only); drop those on modules and module globals."""
    def keep(e) -> bool:
        source = e.orig_guard.source
        return e.guard_type in _STATE_GUARDS or not (
            e.is_global or source.is_unspecialized_nn_module() or source.is_specialized_nn_module())
    return [keep(e) for e in entries]


def compile_static(fn, options: dict | None = None):
    """torch.compile(fn) (fullgraph, static shapes) for a pass whose inputs never change but in their
    values: the same buffers, views and model at every call.

    dynamo guards everything a trace touched, each module, parameter and global: about 5,000 checks
    for SmolLM2's 30 layers, 0.66 ms of every call on CPU (6% of a 4K token on avx2). Only the state
    guards and those on fn's own inputs stay. That is safe because fn gets a code object of its own
    (dynamo keeps compiled entries per code object, so no other closure, say another model's pass
    over a view of the same shapes, is ever served this one's graph) and because a model's modules
    do not change once its passes are compiled (a model with hooks runs eagerly: `watched`)."""
    func = getattr(fn, "__func__", fn)
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    if hasattr(fn, "__self__"):  # a bound method: bound again
        own = types.MethodType(own, fn.__self__)
    options = dict(options or {}, guard_filter_fn=_guards_on_inputs)
    return cpu_kernels.compile(own, fullgraph=True, dynamic=False, options=options)


def capture_graph(run, models, device: torch.device, warmup: int = 2):
    """(CUDA graph, its outputs) of run(): a few eager warm-up calls on a side stream (lazy
    initialisation, autotuning), then the capture. Warm-up and capture write their K/V into the
    slots of the call they capture; every replay rewrites them."""
    for model in models:  # no host-to-device copy inside the graph
        model.rotary.inv_freq = model.rotary.inv_freq.to(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(warmup):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    made["graphs"] += 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        outputs = run()
    return graph, outputs


def enable_compiled_passes(generator, options: dict | None = None) -> list[GraphedModel]:
    """Every level with a resident cache runs its small passes as torch.compile'd graphs over static
    shapes (captured as CUDA graphs on a GPU); returns the wrappers. `options`: inductor's. Not
    cpp_wrapper by default: on CPU its C++ host code saved 0.6 ms a SmolLM2 token at 4K (10.7 -> 10.1,
    bench.bytes_floor's bf16-stored-compiled-cpp) but multiplied the first compile's minutes."""
    return enable_cuda_graphs(generator, eager_static=generator.device.type != "cuda", compiled=True,
                              options=options)


def enable_cuda_graphs(generator, eager_static: bool = False, compiled: bool = False,
                       options: dict | None = None) -> list[GraphedModel]:
    """Wrap the models of the levels with a resident cache; returns the wrappers (their `replays` count).
    A level already wrapped is wrapped anew around its model: on CUDA a bench's compiled system gets a
    generator with CUDA graphs on, and a wrapper around a wrapper built a view of a view (the first
    compiled run on an H200, session 35)."""
    wrapped = []
    full = generator.full if isinstance(generator.full.cache, (FullCache, OffloadedCache)) else None
    for level in (generator.drafter, generator.middle, full):
        if level is not None:
            # the full level graphs its verification passes only (a prompt's pieces and a chat turn
            # run eagerly whatever their width: Level.feed's one_off)
            limit = generator.max_width + 1 if level is full else MAX_GRAPH_TOKENS
            model = level.model.model if isinstance(level.model, GraphedModel) else level.model
            # captured, a full pass's widths in buckets: a graph per bucket, not per width
            level.model = GraphedModel(model, eager_static=eager_static, max_tokens=limit, compiled=compiled,
                                       options=options, pad_widths=level is full and not eager_static)
            wrapped.append(level.model)
    from .rounds import DeviceRoundProposer, RoundGraph  # rounds builds on this module's views
    for proposer, _ in generator.proposers.values():
        if isinstance(proposer, DeviceRoundProposer):  # each drafter->middle round one graph
            proposer.graph = RoundGraph(proposer, compiled=compiled, capture=not eager_static, options=options)
    return wrapped
