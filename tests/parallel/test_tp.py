"""Tensor parallelism on CPU: two gloo processes against one process, on tiny random models.

One two-process job (spawned once per module, logits compared across ranks at every forward)
computes logits, parameter shapes, retrieval selections and tokens; the tests compare them with
one process. The failure tests run `triforce generate` workers under torchrun's environment (or
through `triforce tp`) and kill or stop one of them.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from triforce.parallel import setup_tensor_parallel
from triforce.speculative import GenerationConfig, Generator, Models, UserError
from triforce.speculative.caches import FullCache
from triforce.speculative.lookup import LookupDrafter
from triforce.model.loader import load_model
from triforce.model.quant import int8_twin

from ..conftest import save_tiny, save_tokenizer

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
TIMEOUT_S = 10.0  # collective timeout in the failure tests: short, so a hang is found quickly
LOGIT_MODELS = {  # name -> save_tiny arguments: GQA, q/k/v biases (qwen2), o_proj bias (row-parallel)
    "llama-gqa": dict(seed=3, heads=4, kv_heads=2),
    "qwen2-bias": dict(seed=4, model_type="qwen2", heads=4, kv_heads=2),
    "llama-o-bias": dict(seed=5, heads=4, kv_heads=4, attention_bias=True),
    # 64-wide heads in bfloat16: the CPU bf16 kernels, and (with avx512_bf16) each rank's keys in tiles
    "llama-bf16": dict(seed=7, hidden=256, heads=4, kv_heads=2, inter=96),
}
LOGIT_DTYPES = {"llama-bf16": torch.bfloat16}  # the others float32
GEN_MODEL = "qwen2-bias"
ENGINES = [("autoregressive", False), ("speculative", True), ("retrieval", False), ("triforce", True),
           ("triforce", False), ("triforce-device", True), ("triforce-device", "lookup")]
# (mode, separate drafter; False = the target's own weights, "lookup" = drafts looked up in the sequence)
# "triforce-device": triforce with its drafter->middle rounds on the device (rounds.py, the GPU default)
GREEDY = GenerationConfig(max_new_tokens=32, budget=32, chunk_size=8, gamma1=3, gamma2=5, draft_window=16,
                          sink_tokens=4, prefill_chunk=48)
SAMPLED = replace(GREEDY, temperature=0.8, top_p=0.9, seed=7)
# the retrieval cache refills and rebuilds, the window wraps: many times (1,500 tokens: 124 rebuilds and
# 24 evictions; 2,000 cost a third more of the module's 7 minutes on 2 loaded cores for no new state)
LONG = replace(GREEDY, max_new_tokens=1500)
LONG_MODES = ("autoregressive", "triforce", "triforce-device")  # under TP; one process decodes only the
# reference (tests/speculative/test_greedy.py holds one process's long triforce runs: 80 s here)


def offload_factory():
    """offload.full_cache_factory, or None while the offload package does not provide it."""
    try:
        from triforce.offload import full_cache_factory
    except ImportError:
        return None
    return full_cache_factory


OFFLOAD = [False, True] if offload_factory() else [False]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------- the work
def logits_of(folder: Path, rank: int, world: int, dist=None, dtype=torch.float32) -> dict:
    """Logits of a prefill (SDPA path), a short piece and decode steps (grouped path)."""
    model = load_model(folder, dtype, rank=rank, world_size=world)
    if dist is not None:
        dist.attach(model)
    ids = tokens(70, seed=1)

    def run(shape):
        cache = FullCache(shape, 128, prefill_chunk=64)
        out = [model(torch.tensor(ids[:40]), cache), model(torch.tensor(ids[40:67]), cache)]
        out += [model(torch.tensor([t]), cache) for t in ids[67:]]
        return torch.cat(out), cache

    logits, cache = run(model.kv_shape())
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return {"logits": logits, "shapes": shapes, "kv_heads": model.kv_shape().num_kv_heads,
            "cache_heads": cache.k.shape[1], "tiled": cache.tiled,
            # the same passes over a cache whose keys are not in tiles (what every rank did before them)
            "plain_logits": run(replace(model.kv_shape(), tiled_keys=False))[0] if cache.tiled else logits}


def models_for(folder: Path, rank: int, world: int, dist=None) -> tuple:
    """float64 target (this rank's shard) and a replicated drafter: the target plus seeded noise."""
    target = load_model(folder, torch.float64, rank=rank, world_size=world)
    if dist is not None:
        dist.attach(target)
    drafter = load_model(folder, torch.float64)  # world_size 1: every rank holds all of it
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.02 * torch.randn(p.shape, dtype=p.dtype, generator=noise))
    return target, drafter


def generate(target, drafter, mode: str, use_drafter: bool, cfg: GenerationConfig, offload: bool, lower=None) -> dict:
    ids = tokens(96, seed=2)
    mode, device_rounds = mode.removesuffix("-device"), mode.endswith("-device")
    cfg = replace(cfg, device_rounds=device_rounds)
    factory = offload_factory()(device="cpu", prefill_chunk=cfg.prefill_chunk) if offload else None
    drafter = LookupDrafter() if use_drafter == "lookup" else drafter if use_drafter else None
    models = Models(target, drafter, proposing_target=lower)
    gen = Generator(models, cfg, mode, len(ids) + cfg.max_new_tokens,
                    full_cache_factory=factory)
    gen.prefill(ids)
    out = {}
    if gen.middle is not None:  # the retrieval selection right after prefill, per (local) KV head
        cache = gen.middle.cache
        out["retrieval_k"] = cache.k[:, :, :cache.budget].clone()
        out["victims"] = cache.victims.clone()
    out["heads"] = {level.name: level.cache.k.shape[1] for level in (gen.full, gen.middle, gen.drafter)
                    if level is not None and hasattr(level.cache, "k")}  # the offloaded store lays out differently
    out["tokens"] = gen.generate()
    out["rebuilds"] = gen.stats.rebuilds
    out["evictions"] = gen.drafter.cache.evictions if gen.drafter is not None else 0
    return out


def adaptive(target, drafter, dist) -> dict:
    """Sampled adaptive triforce. Rank 1's own choices are scrambled, as if its timings differed from
    rank 0's: through `agree` it must still run rank 0's plans and draw rank 0's tokens."""
    ids = tokens(96, seed=2)
    cfg = replace(SAMPLED, adaptive=True)
    gen = Generator(Models(target, drafter), cfg, "triforce", len(ids) + cfg.max_new_tokens,
                    agree=dist.follow_main if dist is not None else None)
    chooser, plans = gen.chooser, []
    if dist is not None and dist.rank == 1:
        scramble = random.Random(1)
        chooser._choose = lambda: scramble.choice(chooser.plans)
    choose = chooser.choose
    chooser.choose = lambda match=None: plans.append(choose(match)) or plans[-1]
    gen.prefill(ids)
    return {"tokens": gen.generate(), "plans": plans}


def compute(folders: dict, rank: int, world: int, dist=None, long_modes=LONG_MODES) -> dict:
    results = {"logits": {name: logits_of(folders[name], rank, world, dist, LOGIT_DTYPES.get(name, torch.float32))
                          for name in LOGIT_MODELS}}
    target, drafter = models_for(folders[GEN_MODEL], rank, world, dist)
    results["greedy"] = {(mode, d, off): generate(target, drafter, mode, d, GREEDY, off)
                         for mode, d in ENGINES for off in OFFLOAD}
    results["sampled"] = {(mode, d): generate(target, drafter, mode, d, SAMPLED, False)["tokens"]
                          for mode, d in ENGINES}
    results["adaptive"] = adaptive(target, drafter, dist)
    results["int8"] = generate(target, drafter, "triforce", False, GREEDY, False, lower=int8_twin(target))["tokens"]
    results["long"] = {mode: generate(target, drafter, mode, True, LONG, offload=mode == "triforce" and bool(OFFLOAD[-1]))
                       for mode in long_modes}
    return results


def _worker(rank: int, folders: dict, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist = setup_tensor_parallel(WORLD, "cpu", timeout=60, check=True)  # check: logits compared every forward
    try:
        results = compute(folders, dist.rank, dist.world_size, dist)
        dist.check_consistent(torch.arange(5.0))
        try:
            dist.check_consistent(torch.arange(5.0) * (rank + 1))
            results["mismatch"] = None
        except UserError as e:
            results["mismatch"] = str(e)
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp-models")
    made = {}
    for name, kw in LOGIT_MODELS.items():
        save_tiny(base / name, vocab=64, **kw)
        made[name] = base / name
    return made


@pytest.fixture(scope="module")
def runs(folders, tmp_path_factory):
    """{1: results of one process, 2: [results of rank 0, rank 1]}."""
    out = tmp_path_factory.mktemp("tp-results")
    mp.spawn(_worker, args=(folders, free_port(), out), nprocs=WORLD, join=True)
    return {1: compute(folders, 0, 1, long_modes=("autoregressive",)), 2: [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]}


# ---------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("name", list(LOGIT_MODELS))
def test_logits_match_single_process(runs, name):
    one = runs[1]["logits"][name]
    ranks = [r["logits"][name] for r in runs[2]]
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])  # all-reduced: bit-identical on every rank
    assert ranks[0]["tiled"] == ranks[1]["tiled"] == one["tiled"]
    if name in LOGIT_DTYPES:  # where the bf16 kernels build, each rank's full cache tiles its keys
        from triforce.model import decode_attention
        assert one["tiled"] == decode_attention.available()
    for run in (one, *ranks):  # keys in tiles change no bit, on either rank
        assert torch.equal(run["logits"], run["plain_logits"])
    if name in LOGIT_DTYPES:  # bfloat16: the shards' partial sums round before the all-reduce adds them
        torch.testing.assert_close(ranks[0]["logits"], one["logits"], rtol=0.05, atol=0.1)
    else:
        torch.testing.assert_close(ranks[0]["logits"], one["logits"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(LOGIT_MODELS))
def test_each_rank_holds_only_its_shard(runs, name):
    full = runs[1]["logits"][name]
    for r in runs[2]:
        local = r["logits"][name]
        assert local["kv_heads"] == local["cache_heads"] == full["kv_heads"] // WORLD
        for param, shape in full["shapes"].items():
            got = local["shapes"][param]
            if param.endswith(("wqkv.weight", "wqkv.bias", "w13.weight", "w13.bias")):
                assert got == (shape[0] // WORLD, *shape[1:]), param  # column parallel
            elif param.endswith(("wo.weight", "w2.weight")):
                assert got == (shape[0], shape[1] // WORLD), param  # row parallel
            else:
                assert got == shape, param  # norms, biases of row-parallel layers, embeddings: replicated


@pytest.mark.parametrize("offload", OFFLOAD, ids=lambda o: "offload" if o else "on-chip")
@pytest.mark.parametrize("mode,use_drafter", ENGINES, ids=lambda x: str(x))
def test_greedy_tokens_match(runs, mode, use_drafter, offload):
    one = runs[1]["greedy"][(mode, use_drafter, offload)]
    ranks = [r["greedy"][(mode, use_drafter, offload)] for r in runs[2]]
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == one["tokens"]
    assert len(one["tokens"]) == GREEDY.max_new_tokens
    for level, heads in one["heads"].items():  # caches of the target hold only the local KV heads
        local = heads if (level == "draft" and use_drafter) else heads // WORLD  # a separate drafter is replicated
        assert all(r["heads"][level] == local for r in ranks), (level, heads, [r["heads"] for r in ranks])


def test_long_offloaded_triforce_with_tp2_is_autoregressive(runs):
    """1,500 new tokens, triforce with the full cache offloaded, two ranks: exactly the tokens of
    autoregressive decoding in one process."""
    reference = runs[1]["long"]["autoregressive"]["tokens"]
    assert len(reference) == LONG.max_new_tokens
    for mode in LONG_MODES[1:]:
        for r in runs[2]:
            assert r["long"][mode]["tokens"] == reference
            assert r["long"][mode]["rebuilds"] > 20 and r["long"][mode]["evictions"] > 20
    assert all(r["long"]["autoregressive"]["tokens"] == reference for r in runs[2])


def test_int8_proposers_under_tp2_are_autoregressive(runs):
    """Each rank quantizes its own shard for the proposing levels; the tokens stay the exact ones."""
    reference = runs[1]["greedy"][("autoregressive", False, False)]["tokens"]
    assert runs[1]["int8"] == reference
    assert all(r["int8"] == reference for r in runs[2])


def test_offload_available():
    if offload_factory() is None:
        pytest.skip("offload.full_cache_factory does not exist yet: the offloaded parametrisation of "
                    "test_greedy_tokens_match did not run")


@pytest.mark.parametrize("mode", ["retrieval", "triforce"])
def test_retrieval_selects_per_local_kv_head(runs, mode):
    """Each rank's retrieval cache is the single-process one restricted to that rank's KV heads."""
    key = (mode, False, False)
    one = runs[1]["greedy"][key]
    heads = one["victims"].shape[1] // WORLD
    for rank, r in enumerate(runs[2]):
        mine = slice(rank * heads, (rank + 1) * heads)
        assert torch.equal(r["greedy"][key]["victims"], one["victims"][:, mine])
        torch.testing.assert_close(r["greedy"][key]["retrieval_k"], one["retrieval_k"][:, mine], rtol=0, atol=1e-10)


@pytest.mark.parametrize("mode,use_drafter", ENGINES, ids=lambda x: str(x))
def test_sampled_tokens_match(runs, mode, use_drafter):
    """Same seed, temperature > 0: one generator per rank seeded alike draws the same tokens."""
    one = runs[1]["sampled"][(mode, use_drafter)]
    ranks = [r["sampled"][(mode, use_drafter)] for r in runs[2]]
    assert ranks[0] == ranks[1] == one
    assert one != runs[1]["greedy"][(mode, use_drafter, False)]["tokens"]  # it did sample


def test_adaptive_ranks_run_rank_0s_plans(runs):
    ranks = [r["adaptive"] for r in runs[2]]
    assert ranks[0]["plans"] == ranks[1]["plans"] and ranks[0]["tokens"] == ranks[1]["tokens"]
    assert len({plan.mode for plan in ranks[0]["plans"]}) >= 2  # it did switch


def test_consistency_check_catches_diverging_ranks(runs):
    for r in runs[2]:
        assert r["mismatch"].startswith("tensor-parallel workers computed different logits"), r["mismatch"]


# ---------------------------------------------------------------------------------------- setup
def test_lone_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    dist = setup_tensor_parallel(1, "cpu")
    assert (dist.rank, dist.world_size, dist.device, dist.group) == (0, 1, "cpu", None)
    with pytest.raises(UserError, match="--tp 2 needs 2 processes: launch with `torchrun"):
        setup_tensor_parallel(2, "cpu")


def test_tp_must_equal_world_size(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"--tp 4 but torchrun started 2 process\(es\)"):
        setup_tensor_parallel(4, "cpu")


def test_bad_timeout(monkeypatch):
    monkeypatch.setenv("SPEC_TP_TIMEOUT", "soon")
    with pytest.raises(UserError, match="SPEC_TP_TIMEOUT"):
        setup_tensor_parallel(1, "cpu")


# ---------------------------------------------------------------------------------------- failures
@pytest.fixture(scope="module")
def cli_model(tmp_path_factory):
    """A tiny checkpoint with a tokenizer, for `triforce generate` (4 heads / 2 KV heads)."""
    folder = tmp_path_factory.mktemp("tp-cli")
    save_tiny(folder, seed=6, vocab=64, layers=1, hidden=16, heads=4, kv_heads=2, inter=16, max_pos=8192)
    save_tokenizer(folder, vocab=64)
    return folder


def start_worker(rank: int, port: int, args: list[str], logs: Path) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
           "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "SPEC_TP_TIMEOUT": str(TIMEOUT_S), "OMP_NUM_THREADS": "1"}
    logs.mkdir(exist_ok=True)
    with open(logs / f"{rank}.out", "w") as out, open(logs / f"{rank}.err", "w") as err:  # files: never blocks
        return subprocess.Popen([sys.executable, "-m", "triforce", "generate", "--tp", str(WORLD), *args],
                                env=env, stdout=out, stderr=err)


def wait_for_output(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while path.stat().st_size == 0:
        assert proc.poll() is None, path.with_suffix(".err").read_text()
        assert time.monotonic() < deadline, "rank 0 generated nothing"
        time.sleep(0.05)


FAILURES = {"rank1-killed": (1, signal.SIGKILL), "rank0-hung": (0, signal.SIGSTOP)}


def test_dead_or_hung_worker_stops_the_other(cli_model, tmp_path):
    """Rank 0 streams text to stdout: once some appears, generation is under way; then one worker is
    killed (its peer sees the connection drop) or stopped (its peer must time out). Both cases run
    at once: the hung one spends most of its time waiting."""
    prompt = " ".join(f"t{t}" for t in tokens(200, seed=3))
    args = ["--model", str(cli_model), "--draft", "self", "--mode", "autoregressive", "--prompt", prompt,
            "--max-new-tokens", "7000", "--device", "cpu", "--rope-scaling", "none"]
    runs = {name: [start_worker(rank, port, args, tmp_path / name) for rank in range(WORLD)]
            for name, port in zip(FAILURES, (free_port(), free_port()))}
    broken, finished = {}, {}
    try:
        for name, (victim, sig) in FAILURES.items():
            wait_for_output(tmp_path / name / "0.out", runs[name][0])
            os.kill(runs[name][victim].pid, sig)
            broken[name] = time.monotonic()
        for name, (victim, _) in FAILURES.items():
            runs[name][1 - victim].wait(timeout=TIMEOUT_S + 60)
            finished[name] = time.monotonic()
    finally:
        for proc in (p for pair in runs.values() for p in pair):
            if proc.poll() is None:
                proc.kill()  # SIGKILL ends a stopped process too
            proc.wait()
    for name, (victim, _) in FAILURES.items():
        survivor = runs[name][1 - victim]
        err = (tmp_path / name / f"{1 - victim}.err").read_text()
        assert survivor.returncode == 2, (name, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines[-1].startswith(f"error: tensor-parallel worker {victim} stopped responding ("), (name, err)
        assert sum(line.startswith("error:") for line in lines) == 1, (name, err)
        assert finished[name] - broken[name] < TIMEOUT_S + 20, (name, finished[name] - broken[name])


def test_kv_heads_not_divisible_is_one_line(tmp_path):
    """Through the launcher: torchrun, two gloo workers, a model with 3 KV heads."""
    save_tiny(tmp_path, seed=7, vocab=64, layers=1, hidden=24, heads=6, kv_heads=3, inter=16)
    save_tokenizer(tmp_path, vocab=64)
    run = subprocess.run([sys.executable, "-m", "triforce", "tp", "--model", str(tmp_path), "--prompt",
                          "t5 t6 t7", "--max-new-tokens", "4", "--device", "cpu"],
                         env={**os.environ, "SPEC_TP_TIMEOUT": str(TIMEOUT_S)}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    # both ranks meet it, and the line is said once between them; a rank torchrun stopped first says
    # at most "interrupted" (rank 0 only), never a traceback
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith("error: tensor parallel degree 2 does not divide the model's 3 KV heads"), run.stderr
    assert set(lines) <= {errors[0], "interrupted"} and len(lines) <= WORLD, run.stderr


def _wait_for_text(path: Path, proc: subprocess.Popen, text: str, count: int, seconds: float = 120) -> str:
    """The file's text once it holds `text` `count` times (the process still running)."""
    deadline = time.monotonic() + seconds
    while (got := path.read_text()).count(text) < count:
        assert proc.poll() is None, (got, path.with_suffix(".err").read_text())
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    return got


def test_a_chat_on_two_ranks_outlasts_a_pause_and_a_ctrl_c(cli_model, tmp_path):
    """`triforce tp chat`, as a person uses it: a pause at the prompt longer than the collectives'
    timeout (the other rank waits for rank 0's input without it), then a Ctrl-C to the launcher
    during an answer, which it passes on: every rank stops after the same round (chat.agreed_stop),
    the chat goes on, and the next answer is what one process answers after the same stopped turn."""
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"t{t}" for t in tokens(400, seed=4)))
    flags = ["--model", str(cli_model), "--book", str(book), "--max-new-tokens", "600", "--temperature", "0",
             "--device", "cpu", "--mode", "autoregressive", "--no-adaptive"]
    out_path, err_path = tmp_path / "chat.out", tmp_path / "chat.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "triforce", "tp", "chat", *flags, "--cache-dir", str(tmp_path / "tp")],
                                stdin=subprocess.PIPE, stdout=out, stderr=err, text=True,
                                env={**os.environ, "SPEC_TP_TIMEOUT": "15"})
    try:
        proc.stdin.write("t5 t6 t7\n")
        proc.stdin.flush()
        _wait_for_text(out_path, proc, "cut at 600", 1)  # the first answer, whole
        time.sleep(20)  # a person thinking: longer than the collectives' 15 s
        proc.stdin.write("t9 t10\n")
        proc.stdin.flush()
        _wait_for_text(out_path, proc, "> t", 2)  # the second answer has begun
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("t11 t12 t13\n/quit\n")
        proc.stdin.close()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = out_path.read_text()
    assert proc.returncode == 0, (said, err_path.read_text())
    assert "error" not in err_path.read_text(), err_path.read_text()
    answers = [line.removeprefix("> ") for line in said.splitlines() if line.startswith("> t")]
    summaries = [line for line in said.splitlines() if " tokens · " in line]
    assert len(answers) == 3 and "stopped" in summaries[1] and "cut at 600" in summaries[2], said
    stopped_after = int(summaries[1].split()[0])
    assert 0 < stopped_after < 600
    assert list((tmp_path / "tp").glob("*-rank1.safetensors"))  # each rank kept its shard of the book

    # one process, the second answer cut after as many tokens as the ranks kept
    from triforce.cli import chat

    one = chat.start(chat.parse_args([*flags, "--cache-dir", str(tmp_path / "one")]), interactive=False)
    try:
        texts = [one.ask("t5 t6 t7").text]

        def stop_at(new, levels, seen=[]):
            seen.extend(new)
            if len(seen) >= stopped_after:
                raise KeyboardInterrupt

        second = one.ask("t9 t10", on_tokens=stop_at)
        assert second.status == "interrupted" and len(second.tokens) == stopped_after
        texts += [second.text, one.ask("t11 t12 t13").text]
    finally:
        one.close()
    assert [" ".join(a.split()) for a in answers] == texts
