"""The statistics' comparison with plain decoding."""
from triforce.runtime.report import versus_plain


def stats(**kw):
    base = {"decode_tokens": 10, "decode_seconds": 1.0, "modes": {}, "estimates": {}}
    return {**base, **kw}


def test_adaptive_run_against_its_predicted_plain_decoding():
    d = stats(modes={"retrieval": 6, "autoregressive": 1}, estimates={"autoregressive": {"gamma": 0, "ms_per_token": 150.0}})
    plain = versus_plain(d, "triforce")
    assert plain["speedup"] == 1.5 and plain["ms_per_token"] == 100.0 and "predicted" in plain["how"]


def test_plain_decoding_is_one_and_a_fixed_mode_has_nothing_to_compare_with():
    assert versus_plain(stats(), "autoregressive")["speedup"] == 1.0
    assert versus_plain(stats(), "triforce") is None
    assert versus_plain(stats(decode_tokens=0), "autoregressive") is None
