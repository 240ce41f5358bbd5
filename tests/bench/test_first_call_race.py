"""bench/first_call_race.py: the children run, both arms are counted, and a warmed process never races."""
import json

import pytest

from bench import first_call_race


def test_counts_both_arms_and_a_warmed_child_does_not_race(tmp_path, capsys):
    out = tmp_path / "race.json"
    counts = first_call_race.main(["--processes", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == counts
    assert counts["cold"]["processes"] == counts["warm"]["processes"] == 2
    assert counts["warm"]["raced_processes"] == 0
    printed = capsys.readouterr().out
    assert "| warm | 2 | 0 |" in printed


def test_rejects_no_processes():
    with pytest.raises(SystemExit, match="--processes must be at least 1"):
        first_call_race.main(["--processes", "0"])
