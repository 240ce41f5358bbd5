"""bench.gpu_compare: two runs of the GPU plan side by side, one step at one context."""
import json

import pytest

from bench import gpu_compare
from triforce.model.errors import UserError


def write_run(path, device, rows, step="kv host greedy"):
    path.write_text(json.dumps({"device": device, "steps": [
        {"name": "link floor", "result": [{"raw_h2d_GBps": 55.0}]},
        {"name": step, "result": {"device": "cuda", "rows": rows}}]}))
    return path


def row(system, tps, context=32768):
    return {"context": context, "system": system, "tokens_per_second": tps}


def test_the_table_gives_each_system_both_runs_and_their_ratio(tmp_path, capsys):
    before = write_run(tmp_path / "b.json", "NVIDIA H200", [row("autoregressive", 50.0), row("triforce", 100.0),
                                                            row("triforce", 7.0, context=4096)])
    after = write_run(tmp_path / "a.json", "NVIDIA H200", [row("autoregressive", 50.0), row("triforce", 250.0),
                                                           row("adaptive", 260.0)])
    gpu_compare.main([str(before), str(after), "--step", "kv host greedy", "--context", "32768"])
    out = capsys.readouterr().out
    assert "| triforce | 100.0 | 250.0 | 2.50x |" in out
    assert "| autoregressive | 50.0 | 50.0 | 1.00x |" in out
    assert "| adaptive | - | 260.0 | - |" in out  # a system one run lacks


def test_runs_of_different_devices_are_refused(tmp_path):
    before = write_run(tmp_path / "b.json", "NVIDIA H100", [row("triforce", 100.0)])
    after = write_run(tmp_path / "a.json", "NVIDIA H200", [row("triforce", 250.0)])
    with pytest.raises(UserError, match="different devices"):
        gpu_compare.main([str(before), str(after), "--step", "kv host greedy", "--context", "32768"])


def test_a_missing_step_or_context_names_what_the_run_has(tmp_path):
    run = write_run(tmp_path / "b.json", "NVIDIA H200", [row("triforce", 100.0)])
    with pytest.raises(UserError, match="pick one of link floor, kv host greedy"):
        gpu_compare.step_rows(run, "kv gpu greedy", 32768)
    with pytest.raises(UserError, match="no row at context 4096"):
        gpu_compare.step_rows(run, "kv host greedy", 4096)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match="cannot read"):
        gpu_compare.step_rows(tmp_path / "bad.json", "kv host greedy", 4096)


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "b.json", "NVIDIA H200", [row("triforce", 100.0)])
    out = tmp_path / "x.png"
    gpu_compare.main([str(run), str(run), "--step", "kv host greedy", "--context", "32768", "--out", str(out)])
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_system_one_run_lacks_is_not_plotted_as_zero():
    rows = gpu_compare.compare({"retrieval": 200.0, "speculative": 70.0}, {"retrieval": 300.0, "hf-static": 9.0})
    assert gpu_compare.plotted(rows) == [("retrieval", 200.0, 300.0)]
    assert "| speculative | 70.0 | - | - |" in gpu_compare.table(rows, ("a", "b"))


def test_two_steps_of_one_run_side_by_side(tmp_path, capsys):
    """The previous default gamma2 beside the offloaded default (16): two steps of the same run."""
    run = tmp_path / "r.json"
    run.write_text(json.dumps({"device": "NVIDIA H200", "steps": [
        {"name": "kv host greedy", "result": {"rows": [row("retrieval", 200.0)]}},
        {"name": "gamma2 6 kv host greedy", "result": {"rows": [row("retrieval", 300.0)]}}]}))
    gpu_compare.main([str(run), str(run), "--step", "kv host greedy", "--after-step", "gamma2 6 kv host greedy",
                      "--context", "32768", "--labels", "gamma2 16,gamma2 6"])
    out = capsys.readouterr().out
    assert "| system | gamma2 16 tok/s | gamma2 6 tok/s |" in out and "| retrieval | 200.0 | 300.0 | 1.50x |" in out
