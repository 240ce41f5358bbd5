"""bench.host_overhead at toy size: every mode and transformers' StaticCache row, JSON written,
one host wait per round where no middle level verifies, eager kernels per layer for every level's
pass, tables that fit 80 columns."""
import json

from bench import host_overhead


def test_host_overhead_small(tmp_path, capsys):
    out = tmp_path / "ho.json"
    assert host_overhead.main(["--layers", "2", "--hidden", "32", "--context", "120", "--new-tokens", "8",
                               "--budget", "64", "--chunk", "8", "--no-compile", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    ours = [r for r in rows if r["mode"] != "hf-static"]
    systems = (*host_overhead.MODES, "triforce-device")
    assert {(r["mode"], r["sampled"]) for r in ours} == {(m, s) for m in systems for s in (False, True)}
    for r in ours:
        assert r["ops_per_token"] > 0 and r["host_ms_per_pass"] > 0
        # every level's passes go through Transformer.forward; sampling and acceptance do not
        assert 0 < r["ops_outside_passes"] < 0.5
        if r["mode"] == "triforce":
            assert r["waits_per_round"] > 1  # host-driven rounds: one more per middle-level verification
        else:
            assert r["waits_per_round"] == 1.0 and r["waits_by_site"] == {"tolist": r["rounds"]}
    assert [r["mode"] for r in rows][-1] == "hf-static"
    passes = {(r["level"], r["tokens"]) for r in saved["kernels_per_layer"]}
    assert passes == {("draft", 1), ("middle", 1), ("middle", 5), ("verify", 1), ("verify", 5), ("verify", 7)}
    for r in saved["kernels_per_layer"]:
        assert r["eager_ops_per_layer"] > 0 and "compiled_kernels_per_layer" not in r
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines() if not line.startswith(("wrote", "2 layers"))) <= 80
