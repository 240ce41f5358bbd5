"""bench/prefill_rate.py end to end on a tiny random model: the row, the JSON, and the two
prefills agreeing on the last position's logits (what makes their rates comparable)."""
import json
import random

import pytest
import torch

from bench import prefill_rate

from ..conftest import save_tiny, save_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill-rate")
    save_tiny(root, seed=3, vocab=64)
    save_tokenizer(root, vocab=64)
    rng = random.Random(0)
    (root / "book.txt").write_text(" ".join(f"t{rng.randrange(2, 64)}" for _ in range(300)))
    return root


@pytest.mark.parametrize("chunk", [64, 256])  # several pieces (a mask), and the whole prompt in one (causal)
def test_rates_and_agreeing_logits(folder, tmp_path, chunk, capsys):
    out = tmp_path / "rate.json"
    rc = prefill_rate.main(["--model", str(folder), "--prompt-file", str(folder / "book.txt"), "--tokens", "256",
                            "--threads", "1", "--chunk", str(chunk), "--hf-chunks", "0,100", "--repeats", "1",
                            "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr()
    assert "ours/hf" in printed.out and "prefill_rate:" not in printed.out  # progress goes to stderr only
    progress = [line for line in printed.err.splitlines() if line.startswith("prefill_rate:")]
    assert [line.split(" repeat")[0].split()[-1] for line in progress] == ["ours", "hf:0", "hf:100"]
    assert all("repeat 1 of 1: 256 tokens in" in line for line in progress), progress
    data = json.loads(out.read_text())
    assert data["meta"]["threads"] == 1
    (row,) = data["rows"]
    assert row["tokens"] == 256 and row["chunk"] == chunk and row["dtype"] == "float32"
    assert row["hf_chunk"] in (0, 100) and set(row["seconds"]) == {"ours", "hf:0", "hf:100"}
    assert row["ours_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0
    assert row["ratio"] == pytest.approx(row["ours_tokens_per_s"] / row["hf_tokens_per_s"])
    assert row["last_logits_max_abs_diff"] < 1e-4 and row["same_next_token"]


def test_last_logits_match_transformers_for_each_feed(folder):
    """Independently of the timing: ours and transformers' logits after the same 256 ids, every feed."""
    text = (folder / "book.txt").read_text()
    ids = prefill_rate.prompt_ids(str(folder), text, 256)
    ours, hf = prefill_rate.load_pair(str(folder), "float32", 256)
    reference = prefill_rate.hf_prefill(hf, ids, 0)[1]
    for chunk in (1, 31, 32, 100, 256):  # grouped-matmul and SDPA pieces, ragged and whole
        torch.testing.assert_close(prefill_rate.ours_prefill(ours, ids, chunk)[1], reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(prefill_rate.hf_prefill(hf, ids, 100)[1], reference, atol=1e-4, rtol=1e-4)


def test_too_few_tokens_is_a_clean_error(folder, capsys):
    rc = prefill_rate.run_cli(prefill_rate.main, ["--model", str(folder), "--prompt-file", str(folder / "book.txt"),
                                                  "--tokens", "5000", "--repeats", "1"])
    assert rc == 2 and "fewer than --tokens" in capsys.readouterr().err


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """64-wide heads in groups of 3 (SmolLM2's), so that bf16 pieces reach our prefill kernel."""
    root = tmp_path_factory.mktemp("prefill-rate-wide")
    save_tiny(root, seed=4, vocab=64, hidden=192, heads=3, kv_heads=1, inter=128)
    save_tokenizer(root, vocab=64)
    rng = random.Random(1)
    (root / "book.txt").write_text(" ".join(f"t{rng.randrange(2, 64)}" for _ in range(300)))
    return root


def test_sdpa_too_times_our_kernel_against_sdpa(wide_heads, tmp_path, capsys, monkeypatch):
    """--sdpa-too: ours as the engine runs here and ours through the other prefill attention (our
    kernel, or torch's SDPA), alternating; the kernel runs in its run only (where it builds), and the
    two agree on the last logits within bf16's rounding."""
    from triforce.model import attention, decode_attention

    kernel_default = attention.prefill_kernel_serves()

    served = []
    kernel = decode_attention.prefill
    monkeypatch.setattr(decode_attention, "prefill", lambda *a: served.append(a[0].shape[0]) or kernel(*a))
    out = tmp_path / "rate.json"
    rc = prefill_rate.main(["--model", str(wide_heads), "--prompt-file", str(wide_heads / "book.txt"), "--tokens", "256",
                            "--threads", "1", "--chunk", "100", "--dtype", "bfloat16", "--hf-chunks", "0",
                            "--repeats", "1", "--sdpa-too", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr()
    assert "kernel/SDPA" in printed.out
    progress = [line.split(" repeat")[0].split()[-1] for line in printed.err.splitlines() if line.startswith("prefill_rate:")]
    other = "ours-sdpa" if kernel_default else "ours-kernel"
    assert progress == ["ours", other, "hf:0"]
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["seconds"]) == {"ours", other, "hf:0"}
    assert row["prefill_attention"] == ("kernel" if kernel_default else "sdpa")
    assert row["kernel_over_sdpa"] == pytest.approx(row["ours_kernel_tokens_per_s"] / row["ours_sdpa_tokens_per_s"])
    assert attention.PREFILL_KERNEL is None  # the engine's choice again after the runs
    assert row["sdpa_last_logits_max_abs_diff"] < 0.25
    if decode_attention.available():  # pieces of 100, 100 and 56 tokens, 2 layers, in the kernel's warm-up and run only
        assert sorted(served) == [56] * 4 + [100] * 8
