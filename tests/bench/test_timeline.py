"""bench/timeline.py: a profiled run's device activity merged into busy intervals by kind."""
import pytest

from bench import timeline


def test_union_counts_overlaps_once():
    assert timeline.union_length([]) == 0
    assert timeline.union_length([(0, 10), (20, 30)]) == 20  # apart
    assert timeline.union_length([(0, 10), (5, 15)]) == 15  # overlapping
    assert timeline.union_length([(0, 30), (5, 10), (12, 20)]) == 30  # nested
    assert timeline.union_length([(20, 30), (0, 10), (10, 20)]) == 30  # touching, out of order


def test_copies_under_kernels_are_overlap_and_gaps_are_idle():
    # 2 tokens: kernels 0-100 and 150-250 us, a copy 50-200 under both, then nothing until a last
    # kernel at 350-400: the device waited 100 us between 250 and 350
    got = timeline.summarize({"kernels": [(0, 100), (150, 250), (350, 400)], "h2d": [(50, 200)]}, tokens=2)
    ms = 1e-3 / 2
    assert got["device_activity"] and got["wall"] == pytest.approx(400 * ms)
    assert got["kernels"] == pytest.approx(250 * ms) and got["h2d"] == pytest.approx(150 * ms)
    assert got["busy"] == pytest.approx(300 * ms) and got["idle"] == pytest.approx(100 * ms)
    assert got["overlap"] == pytest.approx(100 * ms)  # 50-100 and 150-200
    assert got["launches"] == {"kernels": 3, "h2d": 1, "d2h": 0, "other": 0}
    assert timeline.summarize({}, tokens=3) == {"device_activity": False}


@pytest.mark.parametrize("name,kind", [
    ("Memcpy HtoD (Pinned -> Device)", "h2d"), ("Memcpy DtoH (Device -> Pinned)", "d2h"),
    ("Memcpy DtoD (Device -> Device)", "other"), ("Memset (Device)", "other"),
    ("void at::native::vectorized_elementwise_kernel<4>(...)", "kernels"),
])
def test_kinds_follow_the_profilers_names(name, kind):
    assert timeline.kind_of(name) == kind


def test_a_cpu_run_is_timed_without_the_profiler():
    got = timeline.profile_run(lambda: 4, cuda=False)
    assert got["device_activity"] is False and got["host_wall"] >= 0
    rows = [{"context": 128, "system": "autoregressive", "timeline": got}, {"context": 128, "system": "hf-generate"}]
    assert timeline.table_rows(rows) == [["128", "autoregressive", f"{got['host_wall']:.2f}", "-", "-", "-", "-", "-"]]
