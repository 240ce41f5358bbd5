"""A prefill that starts from what earlier runs kept (runtime/prefill.py): a prompt that begins with a
kept one loads its whole pieces and computes the rest; an interrupted prefill resumes from its
checkpoints. Either way the cache ends bit for bit as a prefill from token 0 leaves it."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import triforce
from triforce.runtime import prefill as prefill_module
from triforce.runtime import prompt_cache
from triforce.speculative import kvfile

from ..conftest import tiny_with_tokenizer
from ..helpers import kept_prompt, run, same_tensors
from .test_prompt_cache import FIXED, kept_files

PIECE = 64
DOCUMENT = " ".join(f"t{3 + (i * 11) % 60}" for i in range(300))
QUESTIONS = (" t5 t9 t7 t5", " t8 t8 t6 t4 t12 t30")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_with_tokenizer(tmp_path_factory, "prompt-prefix", seed=21)


@pytest.mark.parametrize("mode, sampling", [
    ("triforce", dict(temperature=0.0)), ("triforce", dict(temperature=1.0, top_p=0.9, seed=3)),
    ("retrieval", dict(temperature=0.8, seed=5)), ("autoregressive", dict(temperature=1.0, seed=7)),
], ids=["triforce-greedy", "triforce-sampled", "retrieval-sampled", "autoregressive-sampled"])
def test_another_question_after_a_kept_document_reuses_its_pieces(model, cache, tmp_path, monkeypatch, mode, sampling):
    settings = dict(model=str(model), mode=mode, prefill_chunk=PIECE, **FIXED, **sampling)
    document = triforce.generate(DOCUMENT + QUESTIONS[0], prompt_cache="on", **settings)
    calls = []
    asked = triforce.generate(DOCUMENT + QUESTIONS[1], prompt_cache="on", on_prefill=calls.append, **settings)
    prompt_tokens = asked.stats.prompt_tokens
    reused = asked.report["prompt_cache"]["reused"]
    assert reused % PIECE == 0 and prompt_tokens - PIECE < reused + len(QUESTIONS[1].split()) * 2  # all the document's whole pieces
    assert calls[:2] == [0, reused] and sum(calls) == prompt_tokens  # the reused ones in one call, then pieces
    assert asked.report["prompt_cache"]["loaded"] is None and asked.report["prompt_cache"]["kept"]
    fresh = triforce.generate(DOCUMENT + QUESTIONS[1], prompt_cache="off", **settings)
    assert asked.tokens == fresh.tokens
    # bit for bit: the file kept after reusing, joined after the document's, is the one a prefill from
    # token 0 keeps; it holds only the question's tokens, and loads to the same tokens
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "elsewhere"))
    whole = triforce.generate(DOCUMENT + QUESTIONS[1], prompt_cache="on", **settings)
    assert whole.report["prompt_cache"]["reused"] == 0
    kept = Path(asked.report["prompt_cache"]["kept"])
    assert same_tensors(kept_prompt(kept), kept_prompt(whole.report["prompt_cache"]["kept"]))
    assert kvfile.continues(kept) == (Path(document.report["prompt_cache"]["kept"]), reused)
    assert kept.stat().st_size < Path(whole.report["prompt_cache"]["kept"]).stat().st_size / 5
    assert document.report["prompt_cache"]["reused"] == 0
    monkeypatch.setenv("TRIFORCE_CACHE", str(kept.parents[1]))
    loaded = triforce.generate(DOCUMENT + QUESTIONS[1], prompt_cache="on", **settings)
    assert str(loaded.report["prompt_cache"]["loaded"]) == str(kept) and loaded.tokens == fresh.tokens


def test_only_whole_pieces_of_most_of_a_kept_prompt_are_reused(model, cache):
    settings = dict(model=str(model), mode="triforce", temperature=0.0, prefill_chunk=PIECE, **FIXED)
    triforce.generate(DOCUMENT, prompt_cache="on", **settings)
    short = triforce.generate(" ".join(DOCUMENT.split()[:100]) + QUESTIONS[0], prompt_cache="on", **settings)
    assert short.report["prompt_cache"]["reused"] == 0  # under half the kept file: reading it would not pay
    early = triforce.generate("t9 " + DOCUMENT, prompt_cache="on", **settings)
    assert early.report["prompt_cache"]["reused"] == 0  # differs from the first token
    grown = triforce.generate(DOCUMENT + " " + DOCUMENT, prompt_cache="on", **settings)
    assert grown.report["prompt_cache"]["reused"] >= 4 * PIECE  # a document that grew: all of the first copy
    again = triforce.generate(DOCUMENT + " " + DOCUMENT + QUESTIONS[0], prompt_cache="on", **settings)
    assert again.report["prompt_cache"]["reused"] > grown.report["prompt_cache"]["reused"]  # the longest kept
    other = dict(settings, prefill_chunk=2 * PIECE)  # other pieces: another key, nothing to reuse
    assert triforce.generate(DOCUMENT + QUESTIONS[1], prompt_cache="on", **other).report["prompt_cache"]["reused"] == 0
    off = triforce.generate(DOCUMENT + QUESTIONS[1], prompt_cache="off", **settings)
    assert off.report["prompt_cache"] == {"loaded": None, "kept": None, "reused": 0}


def test_a_kept_question_names_the_file_its_first_tokens_come_from(model, cache):
    """A third question continues the document, not the second question's file (whose own tokens it
    does not share); a document that grew twice makes a chain of two links, which loads to the tokens
    a prefill makes."""
    settings = dict(model=str(model), mode="triforce", temperature=0.0, prefill_chunk=PIECE, **FIXED)
    kept = [Path(triforce.generate(DOCUMENT + q, prompt_cache="on", **settings).report["prompt_cache"]["kept"])
            for q in (QUESTIONS[0], QUESTIONS[1], " t3 t3 t3", " t4 t4", " t6")]
    assert kvfile.continues(kept[0]) is None
    assert [kvfile.continues(f)[0] for f in kept[1:]] == [kept[0]] * 4
    grown = [DOCUMENT, DOCUMENT + " " + DOCUMENT, DOCUMENT + " " + DOCUMENT + " " + DOCUMENT + QUESTIONS[0]]
    files = [Path(triforce.generate(text, prompt_cache="on", **settings).report["prompt_cache"]["kept"]) for text in grown]
    # the document alone and the grown one share no more than the first question's file holds
    assert [kvfile.continues(f)[0] for f in files] == [kept[0], kept[0], files[1]]
    assert prompt_cache.linked_files(files[2]) == [files[2], files[1], kept[0]]
    loaded = triforce.generate(grown[2], prompt_cache="on", **settings)
    assert str(loaded.report["prompt_cache"]["loaded"]) == str(files[2])
    assert loaded.tokens == triforce.generate(grown[2], prompt_cache="off", **settings).tokens


def test_a_question_whose_document_is_gone_is_said_and_prefilled(model, cache, caplog, monkeypatch):
    settings = dict(model=str(model), mode="triforce", temperature=1.0, seed=8, prefill_chunk=PIECE, **FIXED)
    document = Path(triforce.generate(DOCUMENT + QUESTIONS[0], prompt_cache="on", **settings).report["prompt_cache"]["kept"])
    asked = triforce.generate(DOCUMENT + QUESTIONS[1], prompt_cache="on", **settings)
    document.unlink()
    with caplog.at_level(logging.WARNING, logger="triforce"):
        again = triforce.generate(DOCUMENT + QUESTIONS[1], prompt_cache="on", **settings)
    assert f"continues {document.name}, which is no longer kept: prefilling it again" in caplog.text
    assert again.tokens == asked.tokens and again.report["prompt_cache"]["kept"]
    assert kvfile.continues(again.report["prompt_cache"]["kept"]) is None  # kept whole this time
    # a document and its question over the folder's limit together: the question is kept whole
    monkeypatch.setenv("TRIFORCE_CACHE", str(cache.parent / "small"))
    first = Path(triforce.generate(DOCUMENT + QUESTIONS[0], prompt_cache="on", **settings).report["prompt_cache"]["kept"])
    monkeypatch.setattr(prompt_cache, "LIMIT_BYTES", first.stat().st_size + 1000)
    second = triforce.generate(DOCUMENT + QUESTIONS[1], prompt_cache="on", **settings)
    assert second.report["prompt_cache"]["reused"] and kvfile.continues(second.report["prompt_cache"]["kept"]) is None
    assert not first.exists() and second.tokens == asked.tokens


def test_a_damaged_kept_prompt_is_said_removed_and_computed(model, cache, caplog):
    settings = dict(model=str(model), mode="triforce", temperature=0.0, prefill_chunk=PIECE, **FIXED)
    path = Path(triforce.generate(DOCUMENT, prompt_cache="on", **settings).report["prompt_cache"]["kept"])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="triforce"):
        asked = triforce.generate(DOCUMENT + QUESTIONS[0], prompt_cache="on", **settings)
    assert f"the kept prompt {path} is corrupt (checksum mismatch): prefilling without it" in caplog.text
    assert asked.report["prompt_cache"]["reused"] == 0 and not path.exists()
    assert asked.tokens == triforce.generate(DOCUMENT + QUESTIONS[0], prompt_cache="off", **settings).tokens


def test_an_interrupted_prefill_resumes_from_its_checkpoints(model, cache, monkeypatch, caplog):
    """Ctrl-C in a long prompt's prefill keeps a checkpoint of what is done; the next run of the prompt
    resumes there and makes the tokens an uninterrupted run makes."""
    settings = dict(model=str(model), mode="triforce", temperature=1.0, seed=4, prefill_chunk=PIECE, **FIXED)
    monkeypatch.setattr(prefill_module, "CHECKPOINT_SECONDS", 1e9)  # none due: Ctrl-C writes the one there is
    pieces = []

    def interrupt_after_three(n):
        pieces.append(n)
        if len(pieces) == 4:  # the start (0), then three pieces
            raise KeyboardInterrupt

    with caplog.at_level(logging.WARNING, logger="triforce"), pytest.raises(KeyboardInterrupt):
        triforce.generate(DOCUMENT, prompt_cache="on", on_prefill=interrupt_after_three, **settings)
    assert "the prefill stopped: 192 of" in caplog.text and "the next run of this prompt resumes from there" in caplog.text
    assert [p.name for p in cache.glob("*.partial/*")] == ["0000000000-0000000192.safetensors"]
    calls = []
    with caplog.at_level(logging.WARNING, logger="triforce"):
        resumed = triforce.generate(DOCUMENT, prompt_cache="on", on_prefill=calls.append, **settings)
    assert "resuming the prefill from a checkpoint: 192 of" in caplog.text and calls[:2] == [0, 192]
    assert resumed.report["prompt_cache"]["reused"] == 192 and resumed.report["prompt_cache"]["kept"]
    assert not list(cache.glob("*.partial"))  # the kept file replaced the checkpoints
    assert resumed.tokens == triforce.generate(DOCUMENT, prompt_cache="off", **settings).tokens


def test_a_prompt_the_cache_cannot_keep_writes_no_checkpoints(model, cache, monkeypatch, caplog):
    """Checkpoints take the bytes the kept prompt would: over the folder's limit, none are written."""
    settings = dict(model=str(model), mode="triforce", temperature=0.0, prefill_chunk=PIECE, **FIXED)
    monkeypatch.setattr(prefill_module, "CHECKPOINT_SECONDS", 0.0)  # one after every piece, were there room
    monkeypatch.setattr(prompt_cache, "LIMIT_BYTES", 1000)
    pieces = []

    def interrupt_after_three(n):
        pieces.append(n)
        if len(pieces) == 4:
            raise KeyboardInterrupt

    with caplog.at_level(logging.WARNING, logger="triforce"), pytest.raises(KeyboardInterrupt):
        triforce.generate(DOCUMENT, prompt_cache="on", on_prefill=interrupt_after_three, **settings)
    assert "the prefill stopped" not in caplog.text and not list(cache.glob("*.partial/*"))


def test_the_command_line_shows_the_reused_tokens(model, cache):
    env = {"TRIFORCE_CACHE": str(cache.parent)}
    args = ["--model", model, "--max-new-tokens", "8", "--temperature", "0", "--prompt-cache", "on",
            "--prefill-chunk", str(PIECE)]
    first = run("generate", *args, "--prompt", DOCUMENT + QUESTIONS[0], env=env)
    second = run("generate", *args, "--prompt", DOCUMENT + QUESTIONS[1], "--json", env=env)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    report = json.loads(second.stdout)
    reused, total = report["prompt_cache"]["reused"], report["prompt_tokens"]
    said = " ".join(second.stderr.split())
    assert f"note: reusing the first {reused:,} of {total:,} prompt tokens from the kept prompt" in said
    assert f"prefill: {total - reused:,} tokens after {reused:,} loaded" in said  # the log's bar: only what is computed
    third = run("generate", *args, "--prompt", DOCUMENT + QUESTIONS[0] + QUESTIONS[1], env=env)
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in third.stdout.splitlines() if line.count("│") == 3}
    assert re.match(r"[0-9,]+ tokens reused from a run before, kept", rows["prompt cache"])  # (the cell wraps)
    assert len(kept_files(cache)) == 3


def test_tensor_parallel_ranks_reuse_the_same_tokens_or_none(model, cache):
    """`triforce tp`: both ranks reuse their shards of a kept document; when one rank's shard is gone,
    neither reuses (their passes run in lockstep), and the tokens are the same."""
    env = {**os.environ, "TRIFORCE_CACHE": str(cache.parent), "SPEC_TP_TIMEOUT": "60"}
    cmd = [sys.executable, "-m", "triforce", "tp", "--model", str(model), "--max-new-tokens", "8", "--device", "cpu",
           "--temperature", "0", "--mode", "triforce", "--no-adaptive", "--budget", "64", "--chunk-size", "8",
           "--prefill-chunk", str(PIECE), "--prompt-cache", "on", "--json"]

    def generate(prompt):
        proc = subprocess.run(cmd + ["--prompt", prompt], env=env, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        return report["tokens"], report["prompt_cache"]

    generate(DOCUMENT + QUESTIONS[0])
    document = kept_files(cache)
    tokens, reusing = generate(DOCUMENT + QUESTIONS[1])
    assert reusing["reused"] >= 4 * PIECE and reusing["kept"]
    for rank in (0, 1):  # each rank's question continues its own shard of the document
        question = Path(reusing["kept"].replace("-rank0.", f"-rank{rank}."))
        assert kvfile.continues(question) == (document[rank], reusing["reused"])
    for path in kept_files(cache):
        if path.name.endswith("-rank1.safetensors"):
            path.unlink()  # rank 1 has neither this prompt nor the document: rank 0 has both
    again_tokens, again = generate(DOCUMENT + QUESTIONS[1])
    assert again == {"loaded": None, "kept": reusing["kept"], "reused": 0} and again_tokens == tokens
    assert [p for p in document if p.exists()] == [document[0]]
