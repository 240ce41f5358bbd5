"""bench.projection_check: the chooser's arithmetic priced against fixed modes run from one prefill."""
import io
import json

from rich.console import Console

from bench import projection_check

MODES = ("autoregressive", "speculative", "retrieval", "triforce")


def test_every_mode_is_timed_priced_and_gives_plain_decodings_tokens(tiny_folder, tmp_path):
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"t{3 + (i * 7) % 50}" for i in range(400)))
    out = tmp_path / "check.json"
    assert projection_check.main(["--model", str(tiny_folder), "--prompt-file", str(book), "--context", "300",
                                  "--new-tokens", "12", "--budget", "128", "--gamma1", "2", "--gamma2", "3",
                                  "--threads", "1", "--dtype", "float32", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["context"] == 300 and figures["budget"] == 128 and len(figures["repeats"]) == 1
    runs = figures["repeats"][0]
    for mode in MODES:
        run = runs[mode]
        assert run["same_tokens_as_plain"], mode  # float32: every mode is plain decoding's tokens
        assert run["ms_per_token"] > 0 and run["predicted_ms_per_token"] > 0, mode
        assert 1 <= run["tokens_per_full_pass"] <= (1 if mode == "autoregressive" else 4), mode
    for mode in MODES[1:]:  # each proposing mode saw verifications: what they yield, both ways
        expected = runs[mode]["expected_tokens"]
        assert 1 <= expected["by position"] <= 4 and 1 <= expected["one rate"] <= 4, mode
    assert {"verify", "draft", "middle"} <= set(runs["pass_costs_ms"])

    console = Console(width=80, file=io.StringIO(), force_terminal=False)
    projection_check.print_tables(figures, console)
    printed = console.file.getvalue()
    assert "…" not in printed and max(map(len, printed.splitlines())) <= 80, printed
    assert "every mode gave plain decoding's tokens" in printed
