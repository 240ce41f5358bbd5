"""Chat picks the strongest prepared model that reads the book, says so, and warns before the
prefill when the model at hand will not answer about a book far past its positions."""
from __future__ import annotations

import pytest

from triforce.model.errors import UserError
from triforce.runtime.book import UPGRADE, choose_chat_model, reading_warning

from ..conftest import save_tiny


def prepared(tmp_path, *names):
    for name in names:
        (tmp_path / name).mkdir()
    return tmp_path


def test_qwen_when_prepared_and_the_book_fits(tmp_path):
    models = prepared(tmp_path, "smollm2-135m", "qwen2.5-coder-1.5b")
    model, why = choose_chat_model(book_chars=420_000, room=2048, models_dir=models)  # ~105K tokens
    assert model == str(models / "qwen2.5-coder-1.5b")
    assert why.startswith("chat model: qwen2.5-coder-1.5b (the strongest prepared model whose 131,072")


def test_smollm2_alone_is_chosen_and_the_choice_says_so(tmp_path):
    models = prepared(tmp_path, "smollm2-135m")
    model, why = choose_chat_model(book_chars=420_000, room=2048, models_dir=models)
    assert model == str(models / "smollm2-135m") and "model; the book is longer than its 8,192 documented positions)" in why
    short, why = choose_chat_model(book_chars=20_000, room=2048, models_dir=models)
    assert short == model and "cover the book" in why


def test_nothing_prepared_names_the_command(tmp_path):
    with pytest.raises(UserError, match="triforce-prepare"):
        choose_chat_model(1000, 100, tmp_path)


def test_a_book_far_past_the_positions_is_warned_about(tmp_path):
    small = tmp_path / "smollm2-135m"
    small.mkdir()
    assert reading_warning(small, 16_000) is None  # 2x its 8,192 positions: still reads
    warning = reading_warning(small, 105_508)
    assert warning.startswith("smollm2-135m documents 8,192 positions and this book has 105,508 tokens (13x)")
    assert warning.endswith(UPGRADE) and "triforce-prepare --all" in warning
    big = tmp_path / "qwen2.5-coder-1.5b"
    big.mkdir()
    assert reading_warning(big, 105_508) is None
    assert "triforce-prepare" not in reading_warning(big, 300_000)  # nothing stronger to fetch


def test_any_other_model_by_its_config(tmp_path):
    save_tiny(tmp_path, seed=1, vocab=64, max_pos=512)
    assert reading_warning(tmp_path, 1024) is None and "512 positions" in reading_warning(tmp_path, 1025)
