"""The transformers peers of our engines, for bench.py and compare_deepspeed.py: Hugging Face
`generate()` (greedy, its default DynamicCache), the same with its static cache (`hf-static`: on CUDA
transformers compiles the decode step for it, as generate() does by itself for a static cache) and
with its offloaded cache (`hf-offloaded`: KV kept in host memory, prefetched layer by layer; it needs
CUDA streams), and assisted generation (`assistant_model=` the same drafter, HF's default settings),
timed the way our engines are: decoding only, from a prefill of the same token ids that each run
starts from (a copy of it, or the static cache rewound to it)."""
from __future__ import annotations

import copy
import time

from bench.measure import ulps_at
from triforce.speculative import ModelConfig
from triforce.speculative.config import CPU_PREFILL_CHUNK
from triforce.speculative.engine import synchronize


SYSTEMS = ("hf-generate", "hf-assisted", "hf-static", "hf-offloaded")
CACHE_OF = {"hf-static": "static", "hf-offloaded": "offloaded"}  # cache_implementation of each, when not dynamic
COMPILED_WARMUPS = 3  # compile, then the CUDA-graph recordings of the compiled step, all before the clock


class HFSystems:
    """transformers' generate() and assisted generation on the same checkpoint, dtype, device, threads.

    `wrap(model) -> model` is applied to the loaded target (compare_deepspeed.py: a ZeRO-3 engine's module);
    `assistant=False` loads no drafter."""

    def __init__(self, session, model_cfg: ModelConfig, wrap=None, assistant: bool = True):
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        # transformers prefills in the pieces ours would (its strongest feed is measured by prefill_rate.py)
        self.torch, self.prefill_chunk = torch, session.run.prefill_chunk or CPU_PREFILL_CHUNK
        self.device = torch.device(session.device)
        self.target = self._load(AutoModelForCausalLM, session.run.model, model_cfg, session.dtype, wrap is None)
        if wrap is not None:
            self.target = wrap(self.target)
        self.assistant = None
        if assistant and session.draft != "self":
            self.assistant = self._load(AutoModelForCausalLM, session.draft, None, session.dtype)
        # A clean generation config: no sampling defaults or EOS from the checkpoint; EOS never stops.
        for m in (self.target, self.assistant):
            if m is not None:
                m.generation_config = GenerationConfig(eos_token_id=None, pad_token_id=None, bos_token_id=None)
        self.calls = {"target": 0, "assistant": 0, "drafted": 0}
        self._hook = self.target.register_forward_hook(lambda *a: self._count("target"))
        if self.assistant is not None:
            self.assistant.register_forward_hook(lambda *a: self._count("assistant"))
            self._pending_cache = None
            original = type(self.assistant).generate

            def generate_with_prompt_cache(*a, **kw):  # hands the assistant its prefilled prompt cache
                if kw.get("past_key_values") is None and self._pending_cache is not None:
                    kw["past_key_values"], self._pending_cache = self._pending_cache, None
                out = original(self.assistant, *a, **kw)
                seqs = out.sequences if hasattr(out, "sequences") else out
                self.calls["drafted"] += seqs.shape[1] - kw["input_ids"].shape[1]
                return out

            self.assistant.generate = generate_with_prompt_cache
        self.prompt_cache = self.assistant_cache = None
        self.caches: dict = {}  # system -> its own prefilled cache (hf-static, hf-offloaded)

    def _count(self, key):
        self.calls[key] += 1

    def _load(self, auto, folder, model_cfg, dtype, to_device=True):
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(folder)
        if model_cfg is not None and model_cfg.rope_scaling:
            params = dict(getattr(cfg, "rope_parameters", None) or {})
            params.update(model_cfg.rope_scaling)
            params.setdefault("rope_theta", model_cfg.rope_theta)
            cfg.rope_parameters = params
            cfg.max_position_embeddings = max(cfg.max_position_embeddings, model_cfg.max_positions)
        model = auto.from_pretrained(folder, config=cfg, dtype=dtype)
        return (model.to(self.device) if to_device else model).eval().requires_grad_(False)

    def _prefill(self, model, prompt: list[int], cache=None):
        from transformers import DynamicCache

        torch = self.torch
        cache = DynamicCache(config=model.config) if cache is None else cache
        chunk = max(self.prefill_chunk, 512)
        with torch.no_grad():
            for i in range(0, len(prompt), chunk):
                ids = torch.tensor([prompt[i:i + chunk]], device=self.device)
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[0, -1]

    def prefill(self, prompt: list[int]) -> tuple[float, int]:
        """HF's own prefill of the prompt (and the assistant's); returns (seconds, first greedy token)."""
        start = time.perf_counter()
        self.prompt_cache, logits = self._prefill(self.target, prompt)
        if self.assistant is not None:
            self.assistant_cache, _ = self._prefill(self.assistant, prompt)
        synchronize(self.device)
        self.prompt = list(prompt)
        self.first_logits = logits.float()
        self.first = int(logits.argmax())
        return time.perf_counter() - start, self.first

    def prefill_cache(self, system: str, n_tokens: int) -> str | None:
        """Prefill the prompt into the cache `system` decodes with (after prefill()); returns why the
        system cannot run here (a line for the table) or None. hf-static gets a StaticCache sized for
        the prompt and `n_tokens`; hf-offloaded a DynamicCache with offloading, which transformers
        only supports on CUDA: anything it raises is the reason."""
        from transformers import DynamicCache, StaticCache

        if system == "hf-static":
            cache = StaticCache(config=self.target.config, max_cache_len=len(self.prompt) + n_tokens)
            if any(type(layer).__name__ != "StaticLayer" for layer in cache.layers):
                return "n/a: sliding-window layers cannot be rewound to the prompt"
        else:
            cache = DynamicCache(config=self.target.config, offloading=True)
        try:
            self._prefill(self.target, self.prompt, cache)
        except Exception as e:  # e.g. on CPU: "Torch not compiled with CUDA enabled"
            return f"n/a on {self.device.type}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.caches[system] = cache
        return None

    def warmups(self, system: str) -> int:
        """Untimed runs before the clock: one, or on CUDA for hf-static enough for transformers to
        compile the decode step and record its CUDA graphs."""
        return COMPILED_WARMUPS if system == "hf-static" and self.device.type == "cuda" else 1

    def _start_cache(self, system: str):
        """The prefilled cache a run starts from: a copy of the prompt's, the static cache rewound to
        the prompt in place (its tensors keep the addresses the compiled step was built on; slots past
        the prompt are masked until rewritten), or the offloaded cache cropped to the prompt (its
        prefetch stream cannot be copied)."""
        if system in ("hf-generate", "hf-assisted"):
            return copy.deepcopy(self.prompt_cache)
        cache = self.caches[system]
        if system == "hf-static":
            for layer in cache.layers:
                layer.cumulative_length.fill_(len(self.prompt))
        else:
            cache.crop(len(self.prompt))
        return cache

    def teacher_forced(self, reference: list[int]) -> dict:
        """Feed `reference` (tokens after the prompt) to the target in one pass and list where it does NOT
        rank the reference token first: {position: [logit gap between its top token and the reference token,
        the gap in units in the last place (ulps) of the model's dtype at the top logit]}."""
        torch = self.torch
        cache = copy.deepcopy(self.prompt_cache)
        with torch.no_grad():
            ids = torch.tensor([reference[:-1]], device=self.device)
            rows = self.target(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float()
        rows = torch.cat([self.first_logits[None].to(rows.device), rows])
        top = rows.max(dim=-1).values
        gaps = top - rows[torch.arange(len(reference)), torch.tensor(reference, device=rows.device)]
        ulp = ulps_at(top, self.target.dtype)
        return {i: [float(g), float(g / u)] for i, (g, u) in enumerate(zip(gaps.tolist(), ulp.tolist())) if g > 0}

    def generation_config(self, n: int, cfg, scores: bool):
        from transformers import GenerationConfig

        kw = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=None,
                  return_dict_in_generate=True, output_scores=scores)
        if cfg.temperature > 0:
            kw.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)  # 0: off, as ours
        else:
            kw.update(do_sample=False)
        return GenerationConfig(**kw)

    def run(self, system: str, n_tokens: int, cfg, scores: bool = False):
        """Decode n_tokens - 1 after the prefill's first token. Returns (tokens, seconds, stats, margins)."""
        torch = self.torch
        ids = torch.tensor([self.prompt + [self.first]], device=self.device)
        cache = self._start_cache(system)
        kw = {}
        if system == "hf-assisted":
            self._pending_cache = copy.deepcopy(self.assistant_cache)
            kw["assistant_model"] = self.assistant
        gen_cfg = self.generation_config(n_tokens - 1, cfg, scores)
        torch.manual_seed(cfg.seed)
        self.calls.update(target=0, assistant=0, drafted=0)
        hooked = system != "hf-static"
        if not hooked:  # a hook inside the compiled step would count at trace time only
            self._hook.remove()
        synchronize(self.device)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                out = self.target.generate(ids, past_key_values=cache, generation_config=gen_cfg, **kw)
            synchronize(self.device)
        finally:
            if not hooked:
                self._hook = self.target.register_forward_hook(lambda *a: self._count("target"))
        seconds = time.perf_counter() - start
        tokens = [self.first] + out.sequences[0, ids.shape[1]:].tolist()
        if not hooked:  # greedy generate(): one forward per new token
            self.calls["target"] = len(tokens) - 1
        margins = None
        if scores and out.scores:
            top2 = torch.stack([s[0].float().topk(2).values for s in out.scores])
            margins = (top2[:, 0] - top2[:, 1]).tolist()
        decode = len(tokens) - 1
        passes = self.calls["target"]
        stats = {"passes": {"verify": passes, "draft": self.calls["assistant"]}, "full_passes": passes,
                 "tokens_per_full_pass": decode / passes if passes else None, "acceptance": {}}
        if system == "hf-assisted" and self.calls["drafted"]:
            stats["acceptance"] = {"draft->verify": max(decode - passes, 0) / self.calls["drafted"]}
        del cache
        return tokens, seconds, stats, margins
