"""A prefilled prompt kept on disk (runtime/prompt_cache.py): the run that loads it makes the tokens a
prefill would, greedy and sampled; a file made for anything else, or damaged, is never used; the
folder keeps its most recently used files within its limit; the command line and tensor parallelism."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import triforce
from triforce.runtime import prompt_cache

from ..conftest import save_tiny, tiny_with_tokenizer
from ..helpers import run

PROMPT = " ".join(f"t{3 + (i * 7) % 60}" for i in range(300))
FIXED = dict(adaptive=False, device="cpu", threads=1, max_new_tokens=24, budget=64, chunk_size=8, gamma1=2, gamma2=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_with_tokenizer(tmp_path_factory, "prompt-cache", seed=12)


def kept_files(folder: Path) -> list[Path]:
    """The kept prompts (not the drafter windows beside them: tests/runtime/test_drafter_window.py)."""
    return sorted(f for f in folder.glob("*.safetensors") if ".window-" not in f.name) if folder.exists() else []


@pytest.mark.parametrize("mode, sampling", [
    ("triforce", dict(temperature=0.0)), ("triforce", dict(temperature=1.0, top_p=0.9, seed=3)),
    ("retrieval", dict(temperature=0.8, seed=5)), ("autoregressive", dict(temperature=1.0, seed=7)),
], ids=["triforce-greedy", "triforce-sampled", "retrieval-sampled", "autoregressive-sampled"])
def test_a_loaded_prompt_makes_the_tokens_a_prefill_makes(model, cache, mode, sampling):
    settings = dict(model=str(model), mode=mode, **FIXED, **sampling)
    prefilled = triforce.generate(PROMPT, prompt_cache="off", **settings)
    assert kept_files(cache) == []
    kept = triforce.generate(PROMPT, prompt_cache="on", **settings)
    assert kept.report["prompt_cache"] == {"loaded": None, "kept": str(kept_files(cache)[0]), "reused": 0}
    calls = []
    loaded = triforce.generate(PROMPT, prompt_cache="on", on_prefill=calls.append, **settings)
    assert loaded.report["prompt_cache"] == {"loaded": str(kept_files(cache)[0]), "kept": None, "reused": 0}
    assert calls == []  # no prefill ran
    assert prefilled.tokens == kept.tokens == loaded.tokens
    assert loaded.stats.prompt_tokens == prefilled.stats.prompt_tokens > 0


def test_one_file_serves_any_sampling(model, cache):
    """The file keeps the prompt's logits, not its first token: another seed or temperature draws again."""
    settings = dict(model=str(model), mode="triforce", **FIXED)
    triforce.generate(PROMPT, prompt_cache="on", temperature=0.0, **settings)
    for sampling in (dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2)):
        loaded = triforce.generate(PROMPT, prompt_cache="on", **settings, **sampling)
        assert loaded.report["prompt_cache"]["loaded"]
        assert loaded.tokens == triforce.generate(PROMPT, prompt_cache="off", **settings, **sampling).tokens
    assert len(kept_files(cache)) == 1


def test_another_prompt_setting_or_weights_misses(model, cache, tmp_path):
    settings = dict(mode="triforce", temperature=0.0, **FIXED)
    model = shutil.copytree(model, tmp_path / "model")
    triforce.generate(PROMPT, model=str(model), prompt_cache="on", **settings)
    other_prompt = triforce.generate(PROMPT + " t5", model=str(model), prompt_cache="on", **settings)
    other_kv = triforce.generate(PROMPT, model=str(model), prompt_cache="on", kv_dtype="float32", **settings)
    # the same config and shapes, other weights, in the same folder: only the weights' files tell
    save_tiny(model, seed=13, vocab=64, layers=2, hidden=32, heads=4, kv_heads=2, inter=48)
    other_weights = triforce.generate(PROMPT, model=str(model), prompt_cache="on", **settings)
    for result in (other_prompt, other_kv, other_weights):
        assert result.report["prompt_cache"]["loaded"] is None and result.report["prompt_cache"]["kept"]
    assert len(kept_files(cache)) == 4
    assert other_weights.tokens == triforce.generate(PROMPT, model=str(model), prompt_cache="off", **settings).tokens


def test_a_damaged_file_is_said_and_prefilled_again(model, cache, caplog):
    settings = dict(model=str(model), mode="triforce", temperature=0.0, **FIXED)
    first = triforce.generate(PROMPT, prompt_cache="on", **settings)
    path = kept_files(cache)[0]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a flipped byte in the last layer's V
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="triforce"):
        again = triforce.generate(PROMPT, prompt_cache="on", **settings)
    assert f"the kept prompt {path} is corrupt (checksum mismatch): prefilling it again" in caplog.text
    assert again.report["prompt_cache"] == {"loaded": None, "kept": str(path), "reused": 0}
    assert again.tokens == first.tokens
    assert triforce.generate(PROMPT, prompt_cache="on", **settings).report["prompt_cache"]["loaded"] == str(path)


def test_off_neither_loads_nor_keeps_and_auto_keeps_slow_prefills(model, cache, monkeypatch):
    settings = dict(model=str(model), mode="triforce", temperature=0.0, **FIXED)
    triforce.generate(PROMPT, prompt_cache="on", **settings)
    assert triforce.generate(PROMPT, prompt_cache="off", **settings).report["prompt_cache"] == {"loaded": None, "kept": None, "reused": 0}
    auto = dict(settings, kv_dtype="float32")  # another key: nothing kept for it yet
    assert triforce.generate(PROMPT, **auto).report["prompt_cache"] == {"loaded": None, "kept": None, "reused": 0}  # a fast prefill
    monkeypatch.setattr(prompt_cache, "PROMPT_CACHE_SECONDS", 0.0)
    assert triforce.generate(PROMPT, **auto).report["prompt_cache"]["kept"]
    assert triforce.generate(PROMPT, **auto).report["prompt_cache"]["loaded"]


def test_the_least_recently_used_files_go_first(tmp_path):
    for age, name in enumerate(["newest", "middle", "oldest"]):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1e9 - age, 1e9 - age))
    (tmp_path / "other.json").write_bytes(b"x" * 1000)  # not a kept prompt: never counted or removed
    prompt_cache.make_room(tmp_path, 250)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["middle.safetensors", "newest.safetensors", "other.json"]
    prompt_cache.make_room(tmp_path, 0)
    assert [p.name for p in tmp_path.iterdir()] == ["other.json"]


def test_a_file_others_continue_goes_after_them(tmp_path):
    """A kept prompt that another continues (kvfile.save's `after`) counts as used when that one was,
    and is removed only after it: no file is left naming a removed one."""
    from triforce.speculative import kvfile

    def kept(name, age, after=None, tokens=100):
        path = tmp_path / f"{name}.safetensors"
        key = {"continues": [f"{after}.safetensors", 50]} if after else {}
        kvfile.save_tensors(path, {"k": torch.zeros(tokens, dtype=torch.int64)}, key)
        os.utime(path, (1e9 - age, 1e9 - age))
        return path

    document = kept("document", age=10)  # kept long ago, continued by the newest question
    other = kept("other", age=5)
    question = kept("question", age=0, after="document", tokens=10)
    assert prompt_cache.linked_files(question) == [question, document]
    size = {p: p.stat().st_size for p in (document, other, question)}
    prompt_cache.make_room(tmp_path, size[document] + size[question])
    assert sorted(tmp_path.iterdir()) == [document, question]  # the unlinked "other" was the least recently used
    prompt_cache.make_room(tmp_path, size[document])
    assert sorted(tmp_path.iterdir()) == [document]  # the question before the document it continues
    kept("question", age=0, after="document", tokens=10)
    prompt_cache.make_room(tmp_path, 0, spare=[document])
    assert sorted(tmp_path.iterdir()) == [document]


def test_a_prompt_over_the_limit_is_said_and_the_variable_raises_it(model, cache, monkeypatch, caplog):
    """A prompt over the folder's limit is not kept, and the note names the variable and a value that
    keeps it; that value keeps it; a value that is not a size is refused before the prefill."""
    settings = dict(model=str(model), mode="triforce", temperature=0.0, **FIXED)
    monkeypatch.setattr(prompt_cache, "LIMIT_BYTES", 1000)
    with caplog.at_level(logging.WARNING, logger="triforce"):
        over = triforce.generate(PROMPT, prompt_cache="on", **settings)
    assert over.report["prompt_cache"]["kept"] is None
    assert "is over the prompt cache's 0.0 MiB (TRIFORCE_PROMPT_CACHE_GIB=2 would keep it)" in caplog.text
    monkeypatch.setenv("TRIFORCE_PROMPT_CACHE_GIB", "2")
    assert triforce.generate(PROMPT, prompt_cache="on", **settings).report["prompt_cache"]["kept"]
    monkeypatch.setenv("TRIFORCE_PROMPT_CACHE_GIB", "lots")
    calls = []
    with pytest.raises(triforce.UserError, match="TRIFORCE_PROMPT_CACHE_GIB='lots' is not a size in GiB; set a number"):
        triforce.generate(PROMPT + " t5", prompt_cache="on", on_prefill=calls.append, **settings)
    assert calls == []  # refused before the prefill


def test_a_loaded_file_is_used_again_last(model, cache, monkeypatch):
    """Loading a file marks it used: under the limit's pressure the file kept longest ago goes first."""
    settings = dict(model=str(model), mode="triforce", temperature=0.0, **FIXED)
    first = triforce.generate(PROMPT, prompt_cache="on", **settings).report["prompt_cache"]["kept"]
    second = triforce.generate(PROMPT + " t5", prompt_cache="on", **settings).report["prompt_cache"]["kept"]
    os.utime(first, (1e9, 1e9)), os.utime(second, (1e9 + 1, 1e9 + 1))
    triforce.generate(PROMPT, prompt_cache="on", **settings)  # loads the first: now the most recent
    monkeypatch.setattr(prompt_cache, "LIMIT_BYTES", Path(first).stat().st_size + Path(second).stat().st_size)
    third = triforce.generate(PROMPT + " t6", prompt_cache="on", **settings).report["prompt_cache"]["kept"]
    assert [str(p) for p in kept_files(cache)] == sorted([first, third])


def test_the_command_line_says_where_the_prompt_came_from(model, cache):
    env = {"TRIFORCE_CACHE": str(cache.parent)}
    args = ["--model", model, "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "0", "--prompt-cache", "on"]
    first, second = run("generate", *args, env=env), run("generate", *args, env=env)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    path = kept_files(cache)[0]
    assert "note: kept the prefilled prompt in" in first.stderr and "prefill: 400 tokens" in first.stderr
    assert "note: loaded the prefilled prompt from" in second.stderr and "--prompt-cache off" in second.stderr
    assert "prefill: 400 tokens" not in second.stderr
    assert first.stdout.splitlines()[0] == second.stdout.splitlines()[0]  # the same text
    assert str(path) in "".join(second.stderr.split())  # the note names the file (wrapped to the terminal)
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in second.stdout.splitlines() if line.count("│") == 3}
    assert rows["prompt cache"] == "loaded: a run before kept this prompt's prefill"
    bad = run("generate", "--model", model, "--prompt", "t3", "--prompt-cache", "always", env=env)
    assert bad.returncode == 2 and "invalid choice: 'always'" in bad.stderr


def test_tensor_parallel_ranks_keep_and_load_their_shards(model, cache):
    """`triforce tp`: each rank keeps its own file and loads it; when one rank's file is gone, every rank
    prefills (in lockstep) and keeps again."""
    env = {**os.environ, "TRIFORCE_CACHE": str(cache.parent), "SPEC_TP_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "triforce", "tp", "--model", str(model), "--prompt", PROMPT, "--max-new-tokens", "8",
           "--device", "cpu", "--temperature", "0", "--mode", "triforce", "--no-adaptive", "--budget", "64", "--chunk-size", "8",
           "--prompt-cache", "on", "--json"]

    def tokens_and_cache():
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        return report["tokens"], report["prompt_cache"]

    kept_tokens, kept = tokens_and_cache()
    files = kept_files(cache)
    stem = files[0].name.removesuffix("-rank0.safetensors")
    assert [f.name for f in files] == [f"{stem}-rank0.safetensors", f"{stem}-rank1.safetensors"]
    assert kept["kept"] == str(files[0])
    windows = sorted(cache.glob("*.window-*.safetensors"))  # each rank's drafter window beside its shard
    window = windows[0].name.removesuffix("-rank0.safetensors")
    assert window.startswith(f"{stem}.window-") and [w.name for w in windows] == [f"{window}-rank{r}.safetensors" for r in (0, 1)]
    loaded_tokens, loaded = tokens_and_cache()
    assert loaded == {"loaded": str(files[0]), "kept": None, "reused": 0} and loaded_tokens == kept_tokens
    files[1].unlink()
    again_tokens, again = tokens_and_cache()
    assert again == {"loaded": None, "kept": str(files[0]), "reused": 0} and again_tokens == kept_tokens
    assert kept_files(cache) == files
