"""The bench harness end to end on tiny random models: rows, JSON, greedy token equality, the plot."""
import json
import random
from dataclasses import replace

import pytest
import torch

from bench import bench, measure, traffic
from bench.hf_peers import HFSystems

from ..conftest import save_tiny, save_tokenizer

SYSTEMS = "autoregressive,speculative,retrieval,triforce,adaptive,hf-generate"


def _prompt(path, n=400, seed=0):
    rng = random.Random(seed)
    path.write_text(" ".join(f"t{rng.randrange(2, 64)}" for _ in range(n)))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target, drafter = root / "target", root / "drafter"
    save_tiny(target, seed=1, vocab=64, max_pos=160)  # 256 + new tokens needs YaRN: a reload per scaling
    save_tokenizer(target, vocab=64)
    save_tiny(drafter, seed=2, vocab=64, layers=1)
    save_tokenizer(drafter, vocab=64)
    return target, drafter, _prompt(root / "book.txt")


def _run(tmp_path, *extra):
    out = tmp_path / "bench.json"
    common = ["--new-tokens", "12", "--repeats", "1", "--budget", "64", "--chunk-size", "8", "--threads", "1",
              "--out", str(out)]
    rc = bench.main([*common, *extra])
    return rc, json.loads(out.read_text())


def test_bench_self_draft_with_hf_generate(tmp_path, models):
    target, _, book = models
    rc, data = _run(tmp_path, "--model", str(target), "--draft", "self", "--prompt-file", str(book),
                    "--contexts", "128,256", "--systems", SYSTEMS + ",hf-assisted")
    assert rc == 0
    rows = data["rows"]
    for context in (128, 256):
        got = {r["system"]: r for r in rows if r["context"] == context}
        assert set(got) == set(SYSTEMS.split(",")) | {"hf-assisted"}
        for name in SYSTEMS.split(","):
            r = got[name]
            assert r["same_tokens"] is True, (name, context)
            assert r["new_tokens"] == 12 and r["tokens_per_second"] > 0 and r["bytes_read_per_token"] > 0
            assert r["speedup_vs_hf_generate"] > 0 and r["speedup"] > 0
        assert "no drafter model" in got["hf-assisted"]["skipped"]  # --draft self: nothing to hand HF
        assert got["autoregressive"]["tokens_per_full_pass"] == pytest.approx(1.0)
        assert got["hf-generate"]["tokens_per_full_pass"] == pytest.approx(1.0)  # one forward per token
        assert got["triforce"]["acceptance"]["middle->verify"] is not None
        assert got["triforce"]["rebuilds"] >= 0 and got["autoregressive"]["rebuilds"] == 0  # retrieval builds
        modes = got["adaptive"]["modes"]  # its first passes: plain decoding, then one mode each by levels
        assert got["triforce"]["modes"] is None and list(modes)[:2] == ["autoregressive", "retrieval"]
        assert sum(modes.values()) == got["adaptive"]["passes"]["verify"]
        scaling = got["hf-generate"]["rope_scaling"]
        assert (scaling is None) == (context == 128)  # each context with the RoPE scaling its length needs
        if scaling:
            assert scaling["rope_type"] == "yarn" and scaling["factor"] == 1.75  # (256 + 12) / 160, in 0.25 steps
    assert data["hardware"]["cpu_cores"] >= 1
    assert ("CPU only" in data["hardware_line"]) != torch.cuda.is_available()
    png = tmp_path / "bench.png"  # several contexts: a plot next to the JSON (when matplotlib is there)
    pytest.importorskip("matplotlib")
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_assisted_with_a_drafter(tmp_path, models):
    target, drafter, book = models
    rc, data = _run(tmp_path, "--model", str(target), "--draft", str(drafter), "--prompt-file", str(book),
                    "--contexts", "200", "--systems", "autoregressive,triforce,hf-generate,hf-assisted")
    assert rc == 0
    got = {r["system"]: r for r in data["rows"]}
    assert set(got) == {"autoregressive", "triforce", "hf-generate", "hf-assisted"}
    assert all(r["same_tokens"] is True for r in got.values())
    assisted = got["hf-assisted"]
    assert assisted["passes"]["draft"] > 0 and 0 <= assisted["acceptance"]["draft->verify"] <= 1
    assert assisted["tokens_per_full_pass"] >= 1


def test_bench_learned_keeps_the_adaptive_choosers_figures(tmp_path, models):
    """--learned: the timed runs of an adaptive system go on from what its warm-up learned; the
    tokens are the same and the JSON says so."""
    target, _, book = models
    rc, data = _run(tmp_path, "--model", str(target), "--draft", "self", "--prompt-file", str(book),
                    "--contexts", "128", "--systems", "autoregressive,adaptive", "--learned")
    assert rc == 0 and data["settings"]["learned"] is True
    got = {r["system"]: r for r in data["rows"]}
    assert got["adaptive"]["same_tokens"] is True and got["adaptive"]["modes"]
    assert got["adaptive"]["graphs_in_clock"] == 0
    # what its chooser believed and had learned, for replaying its choices; none for a fixed mode
    estimates, state = got["adaptive"]["estimates"], got["adaptive"]["chooser_state"]
    assert estimates["autoregressive"]["gamma"] == 0 and estimates["autoregressive"]["ms_per_token"] > 0
    assert state["costs"]["verify"]["1"] > 0 and state["acceptance"]
    assert got["autoregressive"]["chooser_state"] is None and got["autoregressive"]["estimates"] is None
    # on CPU plain decoding waits for each token before the next pass (queued ahead on a GPU), and
    # the full cache is resident here: no store to write
    assert got["autoregressive"]["engine"] == {"queued_ahead": False, "store_writes": None}


def test_bench_timeline_adds_one_more_run_per_system(tmp_path, models, capsys):
    """--timeline: one more run per system of ours (on CPU timed alone: no device to profile), in the
    rows and a third table; transformers' systems get none."""
    target, _, book = models
    rc, data = _run(tmp_path, "--model", str(target), "--draft", "self", "--prompt-file", str(book),
                    "--contexts", "128", "--systems", "autoregressive,adaptive,hf-generate", "--timeline")
    assert rc == 0
    got = {r["system"]: r["timeline"] for r in data["rows"]}
    assert got["hf-generate"] is None
    assert all(got[s]["device_activity"] is False and got[s]["host_wall"] > 0 for s in ("autoregressive", "adaptive"))
    assert "one profiled run per system" in " ".join(capsys.readouterr().out.split())


def test_a_graph_made_inside_the_clock_is_reported(tmp_path, models, monkeypatch, capsys):
    """A timed run that captures or compiles a graph (a pass width the warm-up did not meet) pays
    for it inside the clock: the row counts them and a note says so (the H200's adaptive rows ran
    0.4-0.6 ms a token over their passes' sum, session 37)."""
    from triforce.speculative import graphs
    from triforce.speculative.engine import Generator

    target, _, book = models

    def making_a_graph(real):
        def run(*args, **kwargs):
            graphs.made["graphs"] += 1
            return real(*args, **kwargs)
        return run

    # one graph in each decode, and one while the generator is put back at the prefill, which is
    # outside the clock (as a drafter's restart is) and not counted
    monkeypatch.setattr(Generator, "generate", making_a_graph(Generator.generate))
    monkeypatch.setattr(Generator, "resume", making_a_graph(Generator.resume))
    rc, data = _run(tmp_path, "--model", str(target), "--draft", "self", "--prompt-file", str(book),
                    "--contexts", "128", "--systems", "autoregressive,adaptive,hf-generate")
    assert rc == 0
    got = {r["system"]: r["graphs_in_clock"] for r in data["rows"]}
    assert got == {"autoregressive": 1, "adaptive": 1, "hf-generate": None}  # the warm-up's is not counted
    said = capsys.readouterr()
    out = " ".join((said.out + said.err).split())  # the progress lines go to stderr
    assert "adaptive@128 made 1 graph(s) inside the clock" in out


def test_bench_rejects_unknown_system(tmp_path, models, capsys):
    from triforce.cli.common import run_cli

    target, _, book = models
    rc = run_cli(bench.main, ["--model", str(target), "--prompt-file", str(book), "--systems", "autoregressive,vllm"])
    assert rc == 2 and "unknown system(s) vllm" in capsys.readouterr().err


def test_compare_deepspeed_says_in_one_line_why_it_cannot_run(tmp_path, models, monkeypatch, capsys):
    import sys

    from bench import compare_deepspeed
    from triforce.cli.common import run_cli

    target, _, book = models
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # restored after the test
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed: import raises ImportError
    rc = run_cli(compare_deepspeed.main, ["--model", str(target), "--prompt-file", str(book), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "DeepSpeed ZeRO-Inference cannot run here: deepspeed is not installed" in err[0]


def test_teacher_forced_agrees_with_its_own_greedy_run(tmp_path, models):
    """The tie diagnostic: transformers fed its own greedy tokens ranks every one of them first."""
    from triforce.cli.common import open_session
    from triforce.speculative import GenerationConfig

    target, _, book = models
    plan = bench.parse_args(["--model", str(target), "--draft", "self", "--prompt-file", str(book), "--contexts", "64",
                             "--new-tokens", "10", "--threads", "1"])
    session = open_session(plan.run, book.read_text())
    hf = HFSystems(session, session.config)
    hf.prefill(session.prompt_ids[-64:])
    tokens, _, stats, margins = hf.run("hf-generate", 10, GenerationConfig(max_new_tokens=10), scores=True)
    assert len(tokens) == 10 and len(margins) == 9 and stats["full_passes"] == 9
    assert hf.teacher_forced(tokens) == {}
    other = tokens[:5] + [(tokens[5] + 1) % 64] + tokens[6:]  # a token it would not pick
    assert 5 in hf.teacher_forced(other)


def test_ties_are_gaps_of_a_few_ulps_of_the_dtype():
    import torch

    assert measure.ulps_at(torch.tensor([20.0, -1.5, 0.7]), torch.bfloat16).tolist() == [0.125, 2 ** -7, 2 ** -8]
    assert measure.ties_only({}) and measure.ties_only({13: [0.375, 3.0]}) and not measure.ties_only({13: [2.0, 16.0]})


def test_sweep_rows_and_the_tie_check_tells_a_tie_from_a_divergence(tmp_path, models):
    """sweep.py: greedy rows match autoregressive; the logit-gap check is zero for the reference's own
    token and large for another token, and leaves the shared prefill as it found it."""
    from bench import sweep
    from bench.measure import TIE_ULPS, logit_gap_ulps, run_system
    from triforce.cli.common import generation_config
    from triforce.cli.common import open_session
    from triforce.speculative import Generator

    target, _, book = models
    out = tmp_path / "sweep.json"
    rc = sweep.main(["--model", str(target), "--draft", "self", "--prompt-file", str(book), "--context", "128",
                     "--new-tokens", "10", "--budgets", "32,64", "--gamma2s", "2,3", "--chunk-size", "8", "--threads", "1",
                     "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0 and len(rows) == 8 and all(r["same_tokens"] for r in rows)
    assert {(r["mode"], r["budget"], r["gamma2"]) for r in rows} >= {("retrieval", 32, 2), ("triforce", 64, 3)}

    plan = sweep.parse_args(["--model", str(target), "--draft", "self", "--context", "128", "--new-tokens", "10",
                             "--threads", "1", "--budget", "32", "--chunk-size", "8"])
    session = open_session(plan.run, book.read_text())
    cfg = generation_config(replace(session.run, mode="autoregressive"), len(session.prompt_ids))
    seed = Generator(session.loaded.models, cfg, "autoregressive", max_len=160)
    seed.prefill(session.prompt_ids)
    prefilled = seed.snapshot()
    reference, _, _ = run_system(session, "autoregressive", cfg, prefilled, 160)
    other = list(reference)
    other[4] = (reference[4] + 1) % 64
    assert logit_gap_ulps(session, prefilled, reference, reference, 4) == 0
    assert logit_gap_ulps(session, prefilled, reference, other, 4) > TIE_ULPS
    assert run_system(session, "autoregressive", cfg, prefilled, 160)[0] == reference


def test_traffic_counts_int8_proposer_weights_at_one_byte():
    from triforce.speculative import GenerationConfig, ModelConfig

    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
    gen = GenerationConfig(budget=256)
    bf16, int8 = (traffic.Traffic(cfg, cfg, 2, 2048, 32, gen, lower_elem=e) for e in (None, 1))
    assert int8.full == bf16.full  # verification always reads the exact weights
    weights = traffic.weight_bytes(cfg, 2)
    assert bf16.middle - int8.middle == weights - traffic.weight_bytes(cfg, 1) == weights // 2
    assert bf16.draft - int8.draft == weights // 2


def test_sampled_repetitions_draw_one_seed_each_and_pool(tmp_path, models, monkeypatch):
    """Sampled, each timed repetition draws another text (seed, seed + 1, ...) and a row pools them:
    tokens over seconds and over full passes. The warm-up draws what the first timed run does."""
    target, _, book = models
    texts, real = {}, bench.counted_run

    def recorded(gen, prefilled, learned=False, seed=None):
        tokens, seconds, stats, made = real(gen, prefilled, learned, seed)
        texts.setdefault((gen.mode, seed), []).append(list(tokens))
        return tokens, seconds, stats, made

    monkeypatch.setattr(bench, "counted_run", recorded)
    rc, data = _run(tmp_path, "--model", str(target), "--draft", "self", "--prompt-file", str(book), "--contexts", "128",
                    "--systems", "autoregressive,triforce,hf-generate", "--temperature", "0.8", "--repeats", "3",
                    "--seed", "5")
    assert rc == 0
    for row in data["rows"]:
        runs = row["sampled_runs"]
        assert [r["seed"] for r in runs] == [5, 6, 7], row["system"]
        tokens, seconds = sum(r["decode_tokens"] for r in runs), sum(r["seconds"] for r in runs)
        assert row["tokens_per_second"] == pytest.approx(tokens / seconds)
        assert row["tokens_per_full_pass"] == pytest.approx(tokens / sum(r["full_passes"] for r in runs))
    for mode in ("autoregressive", "triforce"):
        warm_up_and_first, second, third = texts[mode, 5], texts[mode, 6], texts[mode, 7]
        assert warm_up_and_first[0] == warm_up_and_first[1]  # a seed fixes the text
        assert len({tuple(warm_up_and_first[0]), tuple(second[0]), tuple(third[0])}) == 3, mode
    assert data["settings"]["seed"] == 5


def test_greedy_repetitions_keep_the_seed():
    cfg = type("Cfg", (), {"seed": 3, "temperature": 0.0})()
    assert [bench.repetition_seed(cfg, rep) for rep in range(4)] == [3, 3, 3, 3]
    cfg.temperature = 0.7
    assert [bench.repetition_seed(cfg, rep) for rep in range(4)] == [3, 3, 4, 5]
