"""bench/verification.py: its paired expectations are the rules' exact ones, and a run on a tiny model
writes a row per mode with both rules' realized and expected figures."""
import json
import random

import torch

from bench import verification
from tests.speculative.test_block_verification import expected_accepted
from tests.speculative.test_device_sampling import random_dists
from triforce.speculative.sampling import draw_rows


def test_the_paired_expectations_are_the_rules_own():
    gen = torch.Generator().manual_seed(9)
    gains = []
    for case in range(60):
        g = 1 + case % 6
        q, p = random_dists(g, gen, torch.float64), random_dists(g + 1, gen, torch.float64)
        drafts = draw_rows(q, torch.rand(g, generator=gen, dtype=torch.float64))
        block, token = verification.expected_kept(drafts, q, p, None)
        exact_block, exact_token = expected_accepted(drafts.tolist(), list(p), list(q))
        assert abs(block - exact_block) < 1e-9 and abs(token - exact_token) < 1e-9
        gains.append(block - token)
        last = case % (g + 1)  # only the first `last` drafts proposed
        block, token = verification.expected_kept(drafts, q, p, torch.tensor(last))
        exact_block, exact_token = expected_accepted(drafts[:last].tolist(), list(p), list(q))
        assert abs(block - exact_block) < 1e-9 and abs(token - exact_token) < 1e-9
    assert sum(gains) > 0


def test_a_run_writes_both_rules_for_each_mode(tiny_folder, tmp_path):
    rng = random.Random(2)
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"t{rng.randrange(2, 64)}" for _ in range(400)))
    out = tmp_path / "v.json"
    code = verification.main(["--model", str(tiny_folder), "--draft", "self", "--threads", "1", "--prompt-file", str(book),
                              "--context", "300", "--new-tokens", "16", "--seeds", "2", "--budget", "128",
                              "--out", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["retrieval", "triforce"]
    for r in rows:
        assert set(r["realized"]) == {"block", "token"}
        assert all(z["tokens"] == 2 * 15 and z["full_passes"] > 0 for z in r["realized"].values())
        assert r["expected"]["verifications"] > 0 and r["expected"]["block"] >= 0
