"""bench.py measures what generate.py runs: each mode's own GenerationConfig and the generator
Session.generator builds (offload, CUDA-graph wrappers); transformers' static and offloaded caches;
per-level ms per pass and the link floor; --quick, a table within 100 columns, a one-context plot."""
import json
import random
from dataclasses import replace

import pytest
import torch
from rich.console import Console

from bench import bench, bench_report, measure
from bench.measure import OURS
from triforce.cli.common import open_session
from triforce.cli.stats import print_stats_table
from triforce.runtime.session import Session

from ..conftest import save_tiny, save_tokenizer

CONTEXT, NEW = 160, 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_systems")
    target = root / "target"
    save_tiny(target, seed=3, vocab=64, max_pos=512)
    save_tokenizer(target, vocab=64)
    rng = random.Random(1)
    book = root / "book.txt"
    book.write_text(" ".join(f"t{rng.randrange(2, 64)}" for _ in range(400)))
    return target, book


def _flags(target, *extra):
    return ["--model", str(target), "--draft", "self", "--threads", "1", "--chunk-size", "8", *extra]


def _levels(gen):
    """What decides a generator's speed besides its config: each level's model wrapper and cache."""
    return [(lv.name, type(lv.model).__name__, getattr(lv.model, "max_tokens", None), type(lv.cache).__name__,
             getattr(lv.cache, "onchip", None))
            for lv in (gen.drafter, gen.middle, gen.full) if lv is not None] + [gen.mode, gen.gamma]


def _pretend_cuda(session, graphs: bool):
    # --cuda-graphs is refused off CUDA; the wrappers it installs are built without a GPU, and a
    # GraphedModel fed CPU tensors calls the model unchanged, so the structure can be compared here
    if graphs:
        session.run = replace(session.run, cuda_graphs=True)
        session.device = "cuda"


@pytest.mark.parametrize("flag,device,tp,expect", [
    ([], "cuda", 1, True),  # the default on one GPU: a small pass replays a graph
    ([], "cuda", 2, False),  # under tensor parallelism: its all-reduces are not captured
    ([], "cpu", 1, False),
    (["--no-cuda-graphs"], "cuda", 1, False),
    (["--cuda-graphs"], "cuda", 2, "Settings.cuda_graphs does not apply under tensor parallelism"),
    (["--cuda-graphs"], "cpu", 1, "Settings.cuda_graphs needs a CUDA device"),
])
def test_cuda_graphs_are_on_by_default_on_one_gpu(tiny, flag, device, tp, expect):
    from triforce.cli import generate
    from triforce.model.errors import UserError
    from triforce.runtime.settings import check_flags

    target, book = tiny
    opts = generate.parse_args(_flags(target, "--prompt-file", str(book), *flag))
    session = Session(opts.run, book.read_text())
    session.run, session.device = replace(session.run, tp=tp), device  # as a torchrun rank on a GPU would be
    if isinstance(expect, str):
        with pytest.raises(UserError, match=expect):
            check_flags(session.run)
            session.cuda_graphs()
        return
    assert session.cuda_graphs() is expect
    rows = dict(session.choices())
    assert rows.get("CUDA graphs", "off").startswith("on" if expect else "off") and (device == "cuda") == ("CUDA graphs" in rows)


@pytest.mark.parametrize("offload,graphs", [("none", True), ("host", False)])
def test_bench_builds_every_mode_as_generate_does(tiny, offload, graphs):
    from triforce.cli import generate

    target, book = tiny
    text = book.read_text()
    plan = bench.parse_args(_flags(target, "--prompt-file", str(book), "--contexts", str(CONTEXT),
                                   "--new-tokens", str(NEW), "--offload", offload, "--onchip-layers", "1"))
    session = open_session(plan.run, text)
    _pretend_cuda(session, graphs)
    prompt = session.prompt_ids[-CONTEXT:]
    cfgs = bench.system_configs(session.run, OURS, len(prompt))
    prefilled = measure.shared_prefill(session, cfgs, prompt, len(prompt) + NEW)
    ours = bench.system_generators(session, cfgs, prefilled, len(prompt) + NEW)
    for system in OURS:  # generate.py's path: its parse, plan_generation, generator
        mode = measure.engine_mode(system)  # "adaptive": generate.py's default; a mode: --no-adaptive
        opts = generate.parse_args(_flags(target, "--prompt-file", str(book), "--context", str(CONTEXT),
                                          "--max-new-tokens", str(NEW), "--offload", offload, "--onchip-layers", "1",
                                          "--mode", mode, *([] if system == "adaptive" else ["--no-adaptive"])))
        theirs = Session(opts.run, text)
        cfg = theirs.plan_generation()
        assert theirs.run.mode == mode  # the prompt is long enough: no mode switch
        theirs.load()
        _pretend_cuda(theirs, graphs)
        gen = theirs.generator(cfg, max_len=len(theirs.prompt_ids) + NEW)
        assert cfgs[system] == cfg, system
        assert _levels(ours[system]) == _levels(gen), system
        assert (gen.chooser is None) == (system != "adaptive") == (ours[system].chooser is None), system
    # the per-mode defaults differ (CPU: speculative drafts 4 per round, triforce 2), so sharing one was wrong
    assert cfgs["speculative"].gamma1 != cfgs["triforce"].gamma1
    if graphs:
        assert all(lv[1] == "GraphedModel" for lv in _levels(ours["triforce"])[:3])


@pytest.mark.parametrize("system", measure.VARIANTS)
def test_a_variant_is_what_generate_runs_with_its_flags(tiny, system):
    """--systems triforce-device, triforce-host, autoregressive-compiled: the config and levels
    generate.py builds with the flags the variant stands for."""
    from triforce.cli import generate

    target, book = tiny
    text = book.read_text()
    plan = bench.parse_args(_flags(target, "--prompt-file", str(book), "--contexts", str(CONTEXT), "--new-tokens", str(NEW)))
    session = open_session(plan.run, text)
    prompt = session.prompt_ids[-CONTEXT:]
    cfgs = bench.system_configs(session.run, [system], len(prompt))
    prefilled = measure.shared_prefill(session, cfgs, prompt, len(prompt) + NEW)
    ours = bench.system_generators(session, cfgs, prefilled, len(prompt) + NEW)[system]
    opts = generate.parse_args(_flags(target, "--prompt-file", str(book), "--context", str(CONTEXT),
                                      "--max-new-tokens", str(NEW), *measure.system_flags(system)))
    theirs = Session(opts.run, text)
    cfg = theirs.plan_generation()
    theirs.load()
    gen = theirs.generator(cfg, max_len=len(theirs.prompt_ids) + NEW)
    assert cfgs[system] == cfg and _levels(ours) == _levels(gen)
    assert ours.device_rounds == gen.device_rounds == (system == "triforce-device")


def test_bench_times_the_generators_session_builds(tiny, tmp_path, monkeypatch):
    """End to end: every one of our rows decodes with a generator from Session.generator, in its own
    mode and with that mode's config; one generator per system serves the warm-up and the repetitions."""
    from triforce.cli.common import generation_config

    target, book = tiny
    built, real = [], Session.generator

    def spy(self, cfg, max_len, prefilled=None, mode=None, models=None):
        built.append((mode, cfg, prefilled is not None))
        return real(self, cfg, max_len, prefilled=prefilled, mode=mode, models=models)

    monkeypatch.setattr(Session, "generator", spy)
    out = tmp_path / "b.json"
    rc = bench.main(_flags(target, "--prompt-file", str(book), "--contexts", str(CONTEXT), "--new-tokens", str(NEW),
                           "--repeats", "2", "--systems", ",".join(OURS), "--out", str(out)))
    assert rc == 0
    timed = [(m, c) for m, c, shared in built if shared]
    # once each, reused for warm-up + 2 repetitions; "adaptive" builds triforce's levels
    assert [m for m, _ in timed] == [measure.engine_mode(s) for s in OURS]
    prompt_len = len(open_session(bench.parse_args(_flags(target, "--contexts", str(CONTEXT))).run,
                                  book.read_text()).prompt_ids)
    for system, (mode, cfg) in zip(OURS, timed):
        assert cfg == generation_config(replace(bench.parse_args(_flags(target, "--contexts", str(CONTEXT),
                                                                       "--new-tokens", str(NEW))).run, mode=mode,
                                                adaptive=system == "adaptive"), prompt_len)
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["same_tokens"] for r in rows.values())
    assert set(rows["triforce"]["ms_per_pass"]) == {"draft", "middle", "verify"}
    assert all(v > 0 for v in rows["triforce"]["ms_per_pass"].values())
    assert set(rows["autoregressive"]["ms_per_pass"]) == {"verify"} and rows["triforce"]["link_floor"] is None


def test_hf_static_gives_the_greedy_tokens_and_hf_offloaded_says_why_not(tiny, tmp_path):
    target, book = tiny
    out = tmp_path / "b.json"
    rc = bench.main(_flags(target, "--prompt-file", str(book), "--contexts", str(CONTEXT), "--new-tokens", str(NEW),
                           "--repeats", "2", "--systems", "autoregressive,hf-generate,hf-static,hf-offloaded",
                           "--out", str(out)))
    assert rc == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    static = rows["hf-static"]
    assert static["same_tokens"] is True and static["new_tokens"] == NEW and static["tokens_per_second"] > 0
    assert static["passes"]["verify"] == NEW - 1 and static["ms_per_pass"]["verify"] > 0
    assert len(static["seconds_all"]) == 2  # the static cache rewound to the prompt for every run
    offloaded = rows["hf-offloaded"]
    if torch.cuda.is_available():
        assert offloaded["same_tokens"] is True
    else:
        assert offloaded["tokens_per_second"] is None and offloaded["skipped"].startswith("n/a on cpu")


def test_stats_table_has_ms_per_pass_and_the_link_floor(tiny, capsys):
    target, book = tiny
    plan = bench.parse_args(_flags(target, "--prompt-file", str(book), "--contexts", str(CONTEXT),
                                   "--new-tokens", str(NEW), "--offload", "host"))
    session = open_session(replace(plan.run, mode="triforce"), book.read_text())
    cfg = session.plan_generation()
    gen = session.generator(cfg, len(session.prompt_ids) + NEW)
    gen.prefill(session.prompt_ids)
    gen.generate()
    console = Console(record=True, width=200)
    print_stats_table(console, "triforce", gen.stats, device="cpu")
    text = console.export_text()
    for level in ("draft", "middle", "verify"):
        assert f"{level} ms per pass" in text
    assert "link floor n/a on CPU: no host-device link" in text and "MiB KV/pass" in text
    assert "decode ms per token / link floor" in text and "/ n/a" in text


def test_link_floor_is_kv_per_pass_over_the_bandwidth():
    stats = {"bytes_moved": 2_000_000_000, "passes": {"verify": 10}, "tokens_per_full_pass": 2.0}
    floor = measure.link_floor(stats, "cuda", bandwidth=10e9)
    assert floor["kv_bytes_per_full_pass"] == 2e8 and floor["ms_per_full_pass"] == pytest.approx(20.0)
    assert floor["ms_per_token"] == pytest.approx(10.0) and "10.0 GB/s pinned H2D" in floor["text"]
    assert measure.link_floor({"bytes_moved": None, "passes": {"verify": 3}}, "cpu") is None
    assert measure.pinned_h2d_bandwidth("cpu") is None
    assert measure.level_ms_per_pass({"passes": {"draft": 0, "verify": 4}, "seconds": {"draft": 0, "verify": 0.2}}) \
        == {"verify": pytest.approx(50.0)}


def test_quick_says_what_it_runs(tiny):
    target, _ = tiny
    plan = bench.parse_args(["--model", str(target), "--quick"])
    assert (plan.contexts, plan.new_tokens, plan.repeats) == ((1024,), 16, 1)
    assert plan.systems == ("autoregressive", "triforce", "adaptive", "hf-generate") and plan.quick and plan.run.threads == 1
    assert bench.parse_args(["--model", str(target), "--quick", "--threads", "2"]).run.threads == 2
    assert bench.parse_args(["--model", str(target), "--quick", "--systems", "hf-static"]).systems == ("hf-static",)
    assert set(bench.parse_args(["--model", str(target)]).systems) == set(OURS + bench.HF)


def _rows():
    floor = measure.link_floor({"bytes_moved": 3 * 2**30, "passes": {"verify": 8}, "tokens_per_full_pass": 3.1},
                               "cuda", bandwidth=24e9)
    rows = []
    for system in OURS + ("hf-generate", "hf-static"):
        rows.append({"context": 131072, "system": system, "tokens_per_second": 12345.67, "same_tokens": False,
                     "first_mismatch": 17, "tie_only": True, "top2_margin_at_mismatch": 0.125,
                     "acceptance": {"draft->middle": 0.91, "middle->verify": 0.88}, "tokens_per_full_pass": 12.34,
                     "ms_per_pass": {"draft": 1234.5, "middle": 1234.5, "verify": 12345.6},
                     "bytes_read_per_token": 123456 * 2**20, "bytes_moved_per_token": 123456 * 2**20,
                     "link_floor": floor if system in OURS else None})
    rows.append({"context": 131072, "system": "hf-offloaded", "tokens_per_second": None, "same_tokens": None,
                 "skipped": "n/a on cpu: AssertionError: Torch not compiled with CUDA enabled"})
    bench.add_speedups(rows)
    return rows


def test_the_table_fits_100_columns():
    console = Console(record=True, width=300)
    bench_report.print_table(console, _rows())
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    text = "\n".join(lines)
    assert "hf-offloaded@131072: n/a on cpu" in text and "differs from token 17" in text
    assert "floor" in text and "MiB mv/t" in text


def test_device_rounds_show_the_rounds_time_not_a_catch_up_pass():
    rows = [r for r in _rows() if r["system"] == "triforce"]
    rows[0]["ms_per_pass"] = {"draft": 99.3, "draft+middle": 11.6, "verify": 4.5}
    console = Console(record=True, width=300)
    bench_report.print_table(console, rows)
    text = " ".join(console.export_text().split())  # the title wraps
    assert "r 11.6" in text and "99.3" not in text and "r: ms per drafter->middle round run whole" in text


def test_one_context_gets_a_bar_chart_when_asked(tmp_path, monkeypatch):
    rows = [r for r in _rows() if not r.get("skipped")]
    plan = replace(bench.parse_args(["--contexts", "4096"]), out=str(tmp_path / "b.json"))
    drawn = []
    monkeypatch.setattr(bench, "plot", lambda rows, path, title: drawn.append(path) or f"plot: {path}")
    monkeypatch.setattr(bench, "report", lambda *a: {})
    messages = bench.write_results(plan, plan.run, "self", rows, {}, "CPU only")
    assert drawn == [tmp_path / "b.png"] and "plot: " + str(tmp_path / "b.png") in messages
    assert bench.write_results(replace(plan, out=None), plan.run, "self", rows, {}, "CPU only") == []  # not asked
    monkeypatch.undo()
    message = bench_report.plot(rows, tmp_path / "bars.png", "one context")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert message.startswith("no plot: matplotlib is not installed")
        return
    assert (tmp_path / "bars.png").read_bytes()[:4] == b"\x89PNG"


def test_the_json_holds_each_context_as_it_finishes(tiny, tmp_path, monkeypatch):
    """A bench stopped at a time limit (a lent GPU's lease) keeps the contexts it measured: --out is
    rewritten after each, marked partial until the run ends."""
    target, book = tiny
    out, real, seen = tmp_path / "b.json", bench.bench_context, []

    def measure_then_stop(session, plan, ids, context, *rest):
        if seen:  # the second context: the JSON already holds the first
            written = json.loads(out.read_text())
            assert written["partial"] and {r["context"] for r in written["rows"]} == {seen[0]}
            raise KeyboardInterrupt("stopped at the time limit")
        seen.append(context)
        return real(session, plan, ids, context, *rest)

    monkeypatch.setattr(bench, "bench_context", measure_then_stop)
    with pytest.raises(KeyboardInterrupt):
        bench.main(_flags(target, "--prompt-file", str(book), "--contexts", f"{CONTEXT // 2},{CONTEXT}",
                          "--new-tokens", str(NEW), "--systems", "autoregressive", "--out", str(out)))
    assert seen == [CONTEXT // 2]
    monkeypatch.setattr(bench, "bench_context", real)
    assert bench.main(_flags(target, "--prompt-file", str(book), "--contexts", str(CONTEXT), "--new-tokens", str(NEW),
                             "--systems", "autoregressive", "--out", str(out))) == 0
    assert "partial" not in json.loads(out.read_text())  # a finished run's JSON is whole


def test_compiled_systems_warm_up_until_every_width_is_compiled():
    """A width compiles on its HOT_AFTER-th call, and a greedy repetition meets the warm-up's widths
    again: a compiled system warms up HOT_AFTER times, so no compile lands inside the clock."""
    from triforce.speculative.graphs import HOT_AFTER

    assert HOT_AFTER > 1
    assert all(bench.our_warmups(s) == HOT_AFTER for s in measure.VARIANTS if s.endswith("-compiled"))
    assert all(bench.our_warmups(s) == 1 for s in (*measure.OURS, "triforce-device", "triforce-host"))


@pytest.mark.parametrize("extra,expect", [([], "the target itself (--draft self), with lookups weighed beside it"),
                                          (["--no-lookup"], "the target itself (--draft self)"),
                                          (["--no-adaptive"], "the target itself (--draft self)"),
                                          (["--draft", "lookup"], "lookups in the text (--draft lookup)"),
                                          (["--mode", "retrieval"], None)])
def test_the_statistics_say_which_drafter_proposes(tiny, extra, expect):
    from triforce.cli import generate

    target, book = tiny
    opts = generate.parse_args(_flags(target, "--prompt-file", str(book), *extra))
    session = Session(opts.run, book.read_text())
    rows = dict(session.choices(session.plan_generation()))
    assert rows.get("drafter") == (expect if expect is None or "beside" not in expect else
                                   expect + " (--no-lookup: without)")


@pytest.mark.parametrize("extra,expect", [(["--temperature", "0.7"], "; drafts verified by block"),
                                          (["--temperature", "0.7", "--verification", "token"],
                                           "; drafts verified one at a time (--verification token)"),
                                          (["--temperature", "0"], None),
                                          (["--temperature", "0.7", "--mode", "autoregressive"], None)])
def test_the_statistics_say_how_sampled_drafts_are_verified(tiny, extra, expect):
    """--verification reaches the engine's config, and the sampling row says the rule where drafts
    are sampled and verified."""
    from triforce.cli import generate

    target, book = tiny
    opts = generate.parse_args(_flags(target, "--prompt-file", str(book), *extra))
    session = Session(opts.run, book.read_text())
    cfg = session.plan_generation()
    row = dict(session.choices(cfg))["sampling"]
    assert cfg.verification == ("token" if "token" in extra else "block")
    assert row.endswith(expect) if expect else "verified" not in row


@pytest.mark.parametrize("mode", [["--mode", "autoregressive", "--no-adaptive"], []], ids=["plain", "adaptive"])
@pytest.mark.parametrize("extra,expect", [([], "one at a time (default on CPU)"),
                                          (["--queue-ahead"], "the next queued before each token is read"),
                                          (["--no-queue-ahead"], "one at a time")])
def test_the_statistics_say_whether_plain_passes_queue_ahead(tiny, mode, extra, expect):
    """--queue-ahead (the default on a GPU) and the row that says which ran, run fixed or by the
    adaptive default; a generator built with it on reads its plain passes' tokens through TokenReads."""
    from triforce.cli import generate

    target, book = tiny
    opts = generate.parse_args(_flags(target, "--prompt-file", str(book), *mode, "--context", str(CONTEXT), *extra))
    session = Session(opts.run, book.read_text())
    cfg = session.plan_generation()
    assert dict(session.choices(cfg)).get("plain passes") == expect
    session.load()
    gen = session.generator(cfg, max_len=len(session.prompt_ids) + NEW)
    assert (gen.reads is not None) == (extra == ["--queue-ahead"])
