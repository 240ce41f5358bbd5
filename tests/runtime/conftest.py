"""Fixtures the runtime tests share: a tiny chat model and book, and a test's own prompt cache."""
from pathlib import Path

import pytest

from ..conftest import save_byte_level, save_tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny model whose tokenizer is a byte-level BPE with ChatML (the kind SmolLM2 prepares)."""
    made = tmp_path_factory.mktemp("memo-model")
    save_tiny(made, seed=2, vocab=400, max_pos=8192)
    save_byte_level(made)
    return made


@pytest.fixture(scope="module")
def book(tmp_path_factory):
    """A wrapped book (its unwrapped text differs, so lookups search a second list of ids)."""
    path = tmp_path_factory.mktemp("memo-book") / "book.txt"
    path.write_text((ROOT / "triforce" / "data" / "persuasion.txt").read_text()[30_000:34_000])
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """This test's own prompt cache."""
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "prompts"
