"""The cost model (a projection): formula, monotonicity, calibration against the published rows."""
import json
from dataclasses import replace

import pytest

from bench import costmodel as cm


def _setting(**kw):
    base = dict(model=cm.LLAMA2_7B, hw=cm.TP2, context=130_000, budget=12288, gamma2=16, accept_middle=0.9)
    base.update(kw)
    return cm.Setting(**base)


@pytest.mark.parametrize("a,g", [(0.0, 5), (0.5, 1), (0.9, 16), (0.7, 6), (0.999, 30)])
def test_tokens_per_verification_is_the_geometric_sum(a, g):
    assert cm.tokens_per_verification(a, g) == pytest.approx(sum(a ** i for i in range(g + 1)))


def test_tokens_per_verification_limits():
    assert cm.tokens_per_verification(1.0, 16) == 17  # everything accepted + the bonus token
    assert cm.tokens_per_verification(0.0, 16) == 1  # only the corrected token
    assert cm.tokens_per_verification(0.9, 10_000) == pytest.approx(10)  # 1 / (1 - a): the design's "at most 10"
    with pytest.raises(ValueError):
        cm.tokens_per_verification(1.2, 4)


def test_shapes_match_known_sizes():
    assert cm.LLAMA2_7B.params == pytest.approx(6.74e9, rel=0.01)
    assert cm.LLAMA2_13B.params == pytest.approx(13.0e9, rel=0.01)
    assert cm.LLAMA2_7B.kv_bytes_per_token == 512 * 1024  # docs/design.md: 512 KiB per token
    assert cm.LLAMA2_7B.kv_bytes(128 * 1024) == 64 * 2**30  # 64 GiB at 128K


def test_shape_from_project_config(tiny_folder):
    from triforce.speculative import ModelConfig

    shape = cm.ModelShape.from_config(ModelConfig.from_folder(tiny_folder))
    assert (shape.layers, shape.hidden, shape.kv_heads, shape.vocab) == (2, 32, 2, 64)


def test_latency_grows_with_context_and_falls_with_bandwidth():
    short, long = _setting(context=32_000), _setting(context=128_000)
    for f in (cm.autoregressive, cm.triforce, cm.deepspeed_zero_inference):
        assert f(long).seconds_per_token > f(short).seconds_per_token
    fast = _setting(hw=cm.TP2.with_(pcie_bw=50 * cm.GB))
    assert cm.autoregressive(fast).seconds_per_token < cm.autoregressive(_setting()).seconds_per_token
    assert cm.triforce(fast).seconds_per_token < cm.triforce(_setting()).seconds_per_token


def test_triforce_improves_with_acceptance_and_more_onchip_layers_help():
    times = [cm.triforce(_setting(accept_middle=a)).seconds_per_token for a in (0.5, 0.7, 0.9, 0.95)]
    assert times == sorted(times, reverse=True)
    drafts = [cm.triforce(_setting(accept_draft=b, gamma1=4)).seconds_per_token for b in (0.2, 0.5, 0.8)]
    assert drafts == sorted(drafts, reverse=True)
    onchip = [cm.full_pass_seconds(_setting(), onchip=n) for n in (0, 8, 16, 32)]
    assert onchip == sorted(onchip, reverse=True)


def test_triforce_needs_acceptance_to_pay_off():
    s = _setting(accept_middle=0.0)  # every verification yields one token and pays the middle passes too
    assert cm.triforce(s).seconds_per_token > cm.autoregressive(s, onchip=cm.onchip_layers(s)).seconds_per_token
    assert cm.triforce(_setting(accept_middle=0.9)).seconds_per_token < cm.autoregressive(_setting()).seconds_per_token


def test_onchip_layers_fit_memory():
    s = _setting()
    n = cm.onchip_layers(s)
    assert 0 < n < s.model.layers
    more_budget = cm.onchip_layers(replace(s, budget=4 * s.budget))
    assert more_budget < n  # a larger retrieval cache leaves less room for full-cache layers
    assert cm.onchip_layers(replace(s, offloaded=False)) == s.model.layers
    assert cm.onchip_layers(replace(s, hw=cm.TP2.with_(onchip_layers=3))) == 3


def test_calibration_within_tolerance():
    """Every calibrating published row (ms figures) is predicted within the stated tolerance."""
    for row in cm.calibration_table():
        if row["calibrates"]:
            assert abs(row["relative_error"]) <= cm.CALIBRATION_TOLERANCE, row
    # the fitted constant is the least-squares value, rounded
    assert cm.calibrate() == pytest.approx(cm.FITTED_ACCEPT_MIDDLE, abs=0.01)


def test_calibration_covers_every_published_row():
    rows = cm.calibration_table()
    pairs = {(r["setting"], r["model"], r["system"]) for r in rows}
    assert ("2x RTX 4090, TP=2", "Llama2-7B-128K", "triforce") in pairs
    assert ("2x RTX 4090, TP=2", "Llama2-13B-128K", "autoregressive") in pairs
    assert ("1x RTX 4090", "Llama2-7B-128K", "deepspeed") in pairs
    assert ("2x RTX 4090, TP=2", "LWM-Text-Chat-128K", "triforce") in pairs
    assert len(rows) == 9
    published = {(r["setting"], r["model"], r["system"]): r["published_ms"] for r in rows}
    assert published[("2x RTX 4090, TP=2", "Llama2-7B-128K", "triforce")] == 108
    assert published[("1x RTX 4090", "Llama2-7B-128K", "triforce")] == 312


def test_implied_acceptance_reproduces_the_published_figure():
    row = cm.PUBLISHED[0]
    a = cm.implied_acceptance(row)
    assert 0.85 < a < 0.99
    assert cm.predict_row(row, accept_middle=a).ms == pytest.approx(row.published_ms, rel=1e-3)


def test_project_measured_uses_the_given_acceptance():
    low = {r["setting"] + r["model"]: r["projected_ms"] for r in cm.project_measured(0.6, 0.5)}
    high = {r["setting"] + r["model"]: r["projected_ms"] for r in cm.project_measured(0.95, 0.5)}
    assert low.keys() == high.keys() and all(low[k] > high[k] for k in low)


def test_setting_validation():
    with pytest.raises(ValueError):
        _setting(accept_middle=1.5)
    with pytest.raises(ValueError):
        _setting(gamma2=0)
    with pytest.raises(ValueError):
        cm.ModelShape("x", 2, 32, 4, 3, 8, 64, 48)  # heads not a multiple of kv heads


def test_project_cli_prints_projection_label_and_reads_a_bench_json(tmp_path, capsys):
    from bench import project

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"model": "models/smollm2-135m", "rows": [
        {"system": "triforce", "context": 4096, "acceptance": {"draft->middle": 0.7, "middle->verify": 0.8},
         "gamma1": 4, "gamma2": 6, "tokens_per_full_pass": 3.5},
        {"system": "autoregressive", "context": 4096, "acceptance": {}}]}))
    assert project.main(["--bench", str(bench)]) == 0
    out = capsys.readouterr().out
    assert out.count("PROJECTION") >= 2 and "published" in out and "measured" in out
    assert project.main(["--json", "--context", "131072", "--model", "Llama2-13B-128K", "--tp", "2"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["label"].startswith("PROJECTION") and rep["custom"]["triforce_ms"] < rep["custom"]["autoregressive_ms"]


def test_ms_per_token_from_passes_and_when_the_third_level_pays():
    from bench.costmodel import ms_per_token_from_passes as per_token

    # perfect acceptance: a round of gamma proposals yields gamma + 1 tokens
    assert per_token("speculative", {"draft": 1, "verify": 10}, {"draft->verify": 1.0}, 4, 0) == (4 + 10) / 5
    assert per_token("autoregressive", {"verify": 7.5}, {}, 0, 0) == 7.5
    # a full pass that dominates (KV streamed from host memory) and a cheap middle level: three levels win
    ms = {"draft": 0.5, "middle": 1.5, "verify": 60.0}
    accept = {"draft->verify": 0.6, "draft->middle": 0.8, "middle->verify": 0.9}
    assert per_token("triforce", ms, accept, 4, 12) < per_token("speculative", ms, accept, 4, 12)
    # a middle pass costing nearly a full pass (every level reads the same weights, as on a CPU) and a
    # drafter of its own: two levels win (87.8 against 68.6 ms per token)
    ms = {"draft": 20.0, "middle": 100.0, "verify": 110.0}
    accept = {"draft->verify": 0.7, "draft->middle": 0.7, "middle->verify": 0.9}
    assert per_token("triforce", ms, accept, 2, 3) > per_token("speculative", ms, accept, 4, 3)
