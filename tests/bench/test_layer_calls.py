"""bench/layer_calls.py on a tiny model: both ways run, alternate, and are counted."""
import json

import pytest

from bench import layer_calls
from triforce.model import eager_steps, fused_layers, layer_ops


@pytest.mark.skipif(not layer_ops.available(), reason="no C++ compiler for the CPU ops")
@pytest.mark.parametrize("switch", ["layer_ops", "eager_steps", "fused_stack"])
def test_compares_a_shortcut_on_and_off(tiny_folder, tmp_path, capsys, switch):
    out = tmp_path / "layer-calls.json"
    assert layer_calls.main(["--switch", switch, "--model", str(tiny_folder), "--contexts", "40", "--dtypes", "f32",
                             "--tokens", "3", "--rounds", "2", "--weights", "dequantized", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["context"] == 40 and row["tokens_equal"]
    if switch == "layer_ops":
        assert row["ops_per_token_on"] < row["ops_per_token_off"]  # rotation and norms in one call
    else:  # eager_steps: the same kernels, chosen once; fused_stack: dense weights, so no stack either way
        assert row["ops_per_token_on"] == row["ops_per_token_off"]
    assert len(row["runs_ms_per_token"]["on"]) == len(row["runs_ms_per_token"]["off"]) == 2
    assert layer_ops.enabled and eager_steps.enabled and fused_layers.stack_enabled  # left on
    assert "f32" in capsys.readouterr().out
