"""What an adaptive run's chooser learned, kept beside its kept prompt (runtime/learned.py): the next
run of the prompt, or of a question after that document, starts from it; a run with other settings
learns afresh; the folder's limit removes it with its prompt. Greedy tokens are the target's either way."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

import triforce
from triforce.runtime import learned, prompt_cache

from ..conftest import tiny_with_tokenizer
from .test_prompt_prefix import DOCUMENT, PIECE, QUESTIONS

SETTINGS = dict(adaptive=True, mode="triforce", device="cpu", threads=1, max_new_tokens=24, budget=64, chunk_size=8,
                gamma1=2, gamma2=3, prefill_chunk=PIECE, temperature=0.0, prompt_cache="on")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_with_tokenizer(tmp_path_factory, "prompt-learned", seed=23)


def test_a_kept_prompts_next_run_starts_from_what_the_last_one_learned(model, cache, caplog):
    settings = dict(SETTINGS, model=str(model))
    with caplog.at_level(logging.WARNING, logger="triforce"):
        first = triforce.generate(DOCUMENT + QUESTIONS[0], **settings)
    kept = Path(first.report["prompt_cache"]["kept"])
    assert learned.state_path(kept).is_file() and "learned of each mode's speed" not in caplog.text
    assert len(first.report["modes"]) > 1  # a fresh chooser tries the modes
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="triforce"):
        again = triforce.generate(DOCUMENT + QUESTIONS[0], **settings)
    assert "starting from what the last run of this prompt learned of each mode's speed" in caplog.text
    assert again.tokens == first.tokens
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="triforce"):
        asked = triforce.generate(DOCUMENT + QUESTIONS[1], **settings)  # continues the document's file
    assert "starting from what the last run of the prompt it continues learned" in caplog.text
    assert learned.state_path(Path(asked.report["prompt_cache"]["kept"])).is_file()
    assert asked.tokens == triforce.generate(DOCUMENT + QUESTIONS[1], **dict(settings, prompt_cache="off")).tokens
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="triforce"):  # drafts verified one at a time: afresh
        triforce.generate(DOCUMENT + QUESTIONS[0], **dict(settings, verification="token"))
    assert "learned of each mode's speed" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="triforce"):
        triforce.generate(DOCUMENT + QUESTIONS[0], **dict(settings, gamma2=2))  # other plans: afresh
    assert "learned of each mode's speed" not in caplog.text


def test_the_folders_limit_removes_what_was_learned_with_its_prompt(model, cache):
    first = Path(triforce.generate(DOCUMENT + QUESTIONS[0], **dict(SETTINGS, model=str(model))).report["prompt_cache"]["kept"])
    assert learned.state_path(first).is_file()
    prompt_cache.make_room(cache, 0)
    assert not first.exists() and not learned.state_path(first).exists()


def test_a_fixed_mode_keeps_nothing_learned(model, cache):
    kept = Path(triforce.generate(DOCUMENT, **dict(SETTINGS, model=str(model), adaptive=False)).report["prompt_cache"]["kept"])
    assert kept.is_file() and not learned.state_path(kept).exists()
