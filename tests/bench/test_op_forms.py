"""bench.op_forms on CPU (small sizes): every form runs and agrees with the form before; decode rows
carry the split-keys and folded-heads forms' times beside both (GPU figures: docs/results/2026-11-27-gpu-h200-*)."""
import json

from bench import op_forms


def test_op_forms_on_cpu_times_every_form(tmp_path):
    out = tmp_path / "forms.json"
    assert op_forms.main(["--device", "cpu", "--repeats", "30", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    decode = [r for r in rows if r["op"] == "attention decode"]
    assert len(decode) == len(op_forms.SMALL_DECODE)
    for row in decode:
        assert row["us_split"] > 0 and row["max_difference_split"] < 0.05 and row["max_difference"] < 0.05
        assert not any(row["kernels_before"].values())  # no fused CUDA kernel on a CPU
        # a few queries as one-query heads (model/folded_heads.py) beside them, cuDNN not on a CPU
        assert ("us_folded" in row) == (row["T"] > 1) and row.get("folded_cudnn") in (None, False)
        assert row.get("max_difference_folded", 0) < 0.05
