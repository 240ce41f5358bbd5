"""bench/layer_calls.py on a tiny model: both ways run, alternate, and are counted."""
import json

import pytest

from bench import layer_calls
from triforce.model import layer_ops


@pytest.mark.skipif(not layer_ops.available(), reason="no C++ compiler for the CPU ops")
def test_compares_one_call_steps_with_torch_ops(tiny_folder, tmp_path, capsys):
    out = tmp_path / "layer-calls.json"
    assert layer_calls.main(["--model", str(tiny_folder), "--contexts", "40", "--dtypes", "f32", "--tokens", "3",
                             "--rounds", "2", "--weights", "dequantized", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["context"] == 40 and row["tokens_equal"]
    assert row["ops_per_token_one_call"] < row["ops_per_token_torch_ops"]  # rotation and norms in one call
    assert len(row["runs_ms_per_token"]["one_call"]) == len(row["runs_ms_per_token"]["torch_ops"]) == 2
    assert layer_ops.enabled  # left on
    assert "f32" in capsys.readouterr().out
