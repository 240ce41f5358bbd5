"""The measuring tools as a newcomer meets them: one line instead of a traceback where a tool cannot
run here, no citation of files that are not in the checkout, tables that fit 80 columns, progress on
stderr while stdout stays clean."""
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from bench import costmodel as cm
from bench import project

ROOT = Path(__file__).resolve().parents[2]


def test_linkbench_without_a_gpu_says_so_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "bench.linkbench"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "needs a CUDA GPU" in lines[0], proc.stderr


def printed_at_80(*printers) -> str:
    console = Console(width=80, file=io.StringIO(), force_terminal=False)
    for printer in printers:
        printer(console)
    return console.file.getvalue()


MEASURED = [{"model": "models/smollm2-135m", "system": "triforce", "context": 4096, "accept_middle": 0.8,
             "accept_draft": 0.7, "gamma1": 4, "gamma2": 6}]


def test_project_tables_fit_80_columns_with_no_cell_cut():
    out = printed_at_80(lambda c: project.print_calibration(c, cm.calibration_table()),
                        lambda c: project.print_measured(c, MEASURED))
    assert "…" not in out and max(map(len, out.splitlines())) <= 80, out
    rows = [line for line in out.splitlines() if line.startswith("LWM-Text-Chat-128K")]
    assert len(rows) == 2 + 2  # two calibration rows, two projections: a model's name whole, on one line
    calibration = [line for line in out.splitlines() if line.startswith("Llama2-13B-128K ")][:2]
    # a row's cells side by side on one line: published, predicted, error
    assert re.search(r"\b226 ms +227 ms +\+0%", calibration[0]), calibration
    assert re.search(r"\b1794 ms +1888 ms +\+5%", calibration[1]), calibration


def test_project_cites_the_design_note_where_it_lives():
    sources = (ROOT / "bench" / "project.py").read_text() + (ROOT / "bench" / "costmodel.py").read_text()
    assert "DESIGN.md" not in sources
    out = printed_at_80(lambda c: project.print_calibration(c, cm.calibration_table()))
    assert "DESIGN.md" not in out and "docs/design.md" in out and "Published results" in out


def test_pass_cost_says_each_point_on_stderr(tiny_folder, capsys):
    from bench import pass_cost

    assert pass_cost.main(["--model", str(tiny_folder), "--contexts", "16,32", "--tokens", "1,3",
                           "--dtype", "float32", "--repeats", "1"]) == 0
    printed = capsys.readouterr()
    progress = printed.err.splitlines()
    assert [line.split(":")[1].strip() for line in progress] == [
        f"{i} of 4 points, S={s} T={t}" for i, (s, t) in enumerate([(16, 1), (16, 3), (32, 1), (32, 3)], 1)]
    assert "pass_cost:" not in printed.out and "T=3" in printed.out  # the table alone on stdout


def test_pass_cost_times_tiled_and_plain_keys_side_by_side(tmp_path, capsys):
    """A bf16 model with 64-wide heads, where the kernels read tiled keys: a row per layout; on a model
    whose cache cannot tile its keys, one line saying so."""
    from bench import pass_cost
    from tests.conftest import save_tiny
    from triforce.model import decode_attention
    from triforce.model.errors import UserError

    save_tiny(tmp_path, seed=3, vocab=64, layers=2, hidden=192, heads=3, kv_heads=1, inter=96)
    args = ["--model", str(tmp_path), "--contexts", "40", "--tokens", "1,2", "--repeats", "1", "--key-layouts", "tiled,plain"]
    if not decode_attention.available():
        with pytest.raises(UserError, match="tiled only"):
            pass_cost.main([*args, "--dtype", "bfloat16"])
        return
    assert pass_cost.main([*args, "--dtype", "bfloat16"]) == 0
    table = capsys.readouterr().out
    assert "tiled" in table and "plain" in table and "keys" in table
    with pytest.raises(UserError, match="tiled only"):  # float32 keeps its keys plain
        pass_cost.main([*args, "--dtype", "float32"])
    with pytest.raises(UserError, match="one key layout"):
        pass_cost.main([*args, "--dtype", "bfloat16", "--against", "HEAD"])


def test_pass_cost_times_attention_on_tiles_and_avx512_side_by_side(tmp_path, capsys):
    """--attention tiles,avx512: a row per path of attention's products on a CPU with AMX (and this
    process's own path back after); elsewhere, one line saying why not."""
    from bench import pass_cost
    from tests.conftest import save_tiny
    from triforce.model import decode_attention
    from triforce.model.errors import UserError

    save_tiny(tmp_path, seed=3, vocab=64, layers=2, hidden=192, heads=3, kv_heads=1, inter=96)
    args = ["--model", str(tmp_path), "--contexts", "40", "--tokens", "1,2", "--repeats", "1", "--dtype", "bfloat16"]
    before = decode_attention.tiles()
    if not before:
        with pytest.raises(UserError, match="no AMX tiles"):
            pass_cost.main([*args, "--attention", "tiles,avx512"])
        return
    assert pass_cost.main([*args, "--attention", "tiles,avx512"]) == 0
    table = capsys.readouterr().out
    assert "tiles" in table and "avx512" in table and "attention" in table
    assert decode_attention.tiles() == before
    with pytest.raises(SystemExit):
        pass_cost.main([*args, "--attention", "tiles", "--key-layouts", "tiled"])


@pytest.mark.parametrize("flag", ["--products", "--attention"])
def test_pass_cost_times_float32_kernels_in_avx512_and_avx2_code(flag, tmp_path, capsys):
    """--dtype float32 --products (--attention) avx512,avx2: a row per code of the stored blocks'
    float32 kernels (of attention's) on a CPU with avx512f, the process's own code back after;
    elsewhere one line saying why not."""
    from bench import pass_cost
    from tests.model.test_stored import write_tiny_gguf
    from triforce.model import cpu_kernels, decode_attention_f32, stored_avx2
    from triforce.model.errors import UserError

    module, what = (stored_avx2, "products") if flag == "--products" else (decode_attention_f32, "attention")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, seed=2)
    args = ["--model", str(path), "--contexts", "40", "--tokens", "1,3", "--repeats", "1", "--dtype", "float32"]
    with pytest.raises(SystemExit):  # AMX is a bfloat16 path
        pass_cost.main([*args, flag, "amx,tiles,avx2"])
    before = module.code()
    if not cpu_kernels.wide_default():
        with pytest.raises(UserError, match=f"no avx512f float32 {what}"):
            pass_cost.main([*args, flag, "avx512,avx2"])
        return
    assert pass_cost.main([*args, flag, "avx512,avx2"]) == 0
    table = capsys.readouterr().out
    assert "avx512" in table and "avx2" in table and what in table
    assert module.code() == before


BEFORE_CSRC = "317a4d4"  # the last commit whose kernels' C++ was Python strings (moved to model/csrc/ next)


def _has_commit(rev: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_commit(BEFORE_CSRC), reason="not a git checkout with the project's history")
def test_old_kernel_sources_are_read_from_strings_and_from_csrc_files(monkeypatch):
    """bench.attention_rows --old builds an earlier revision's kernels: before session 43 from a string
    in decode_attention.py, since from the files of model/csrc/ that cpu_kernels.csrc joins. The move
    kept the code: the old string is the files' text without the header comment each file gained (and
    with the comments' "PRELUDE's" now "prelude.h's")."""
    from bench.attention_rows import module_string
    from triforce.model import cpu_kernels, decode_attention

    monkeypatch.chdir(ROOT)
    old = module_string(BEFORE_CSRC, "triforce/model/decode_attention.py", "SOURCE")
    unheaded = "".join("\n" + cpu_kernels.csrc(name).split("\n\n", 1)[1] for name in ("amx_frame.h", "decode_attention.cpp"))
    assert old.replace("PRELUDE's", "prelude.h's") == unheaded
    assert "TORCH_LIBRARY(triforce_decode," in old
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "triforce/model"], cwd=ROOT).returncode == 0
    committed = subprocess.run(["git", "cat-file", "-e", "HEAD:triforce/model/csrc/decode_attention.cpp"],
                               cwd=ROOT, capture_output=True).returncode == 0
    if unchanged and committed:  # a tree with edits to the kernels compares at its next commit
        assert module_string(head, "triforce/model/decode_attention.py", "SOURCE") == decode_attention.SOURCE
