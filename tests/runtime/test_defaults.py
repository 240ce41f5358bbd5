"""--threads auto: the cores other work keeps busy now, not the last minute's load average (which
still counts a run that just ended)."""
import os

from triforce.runtime import defaults


def scripted(monkeypatch, times, load=0.8, cores=2, own=(0, 0), window=None):
    """/proc/stat's (all, idle) ticks and this process's own ticks as given, in order; `window`: the
    seconds since the busy window opened (None: none open, so the call samples by sleeping)."""
    ticks, mine = iter(times), iter(own)
    slept = []
    monkeypatch.setattr(defaults, "cpu_times", lambda: next(ticks))
    monkeypatch.setattr(defaults, "own_ticks", lambda: next(mine))
    monkeypatch.setattr(defaults.time, "sleep", slept.append)
    monkeypatch.setattr(defaults, "_window", None)
    clock = [100.0]
    monkeypatch.setattr(defaults.time, "monotonic", lambda: clock[0])
    if window is not None:
        defaults.open_busy_window()
        clock[0] += window
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    return slept


def test_an_idle_machine_after_a_run_gets_every_core(monkeypatch):
    scripted(monkeypatch, [(1000, 400), (1050, 450)], load=0.8)  # idle now; the load average remembers
    assert defaults.auto_threads() == (2, "auto: 2 cores, 0.0 busy")


def test_a_core_busy_now_is_left_to_its_work(monkeypatch):
    scripted(monkeypatch, [(1000, 400), (1050, 425)], load=0.1)  # half the ticks busy: 1 of 2 cores
    assert defaults.auto_threads() == (1, "auto: 2 cores, 1.0 busy")


def test_a_busy_machine_still_gets_one_thread(monkeypatch):
    scripted(monkeypatch, [(1000, 400), (1100, 400)], cores=4)
    assert defaults.auto_threads()[0] == 1


def test_the_seconds_a_start_spends_loading_are_the_window(monkeypatch):
    """Opened as the process started, the window spans its imports and loading: no sleep, and this
    process's own CPU time in it is no other work's."""
    slept = scripted(monkeypatch, [(1000, 400), (1400, 600)], own=(10, 210), window=2.0)
    assert defaults.auto_threads() == (2, "auto: 2 cores, 0.0 busy")  # 200 of the 200 busy ticks ours
    assert slept == [0.0]
    slept = scripted(monkeypatch, [(1000, 400), (1400, 600)], own=(10, 10), window=2.0)
    assert defaults.auto_threads() == (1, "auto: 2 cores, 1.0 busy")  # none ours: a core's worth of other work


def test_a_window_too_young_waits_out_the_quarter_and_one_too_old_samples_afresh(monkeypatch):
    slept = scripted(monkeypatch, [(1000, 400), (1050, 450)], own=(0, 0), window=0.1)
    defaults.auto_threads()
    assert len(slept) == 1 and abs(slept[0] - (defaults.BUSY_SAMPLE_SECONDS - 0.1)) < 1e-9
    slept = scripted(monkeypatch, [(1000, 400), (1000, 400), (1050, 400)], own=(0, 0, 0), window=60)
    assert defaults.auto_threads() == (1, "auto: 2 cores, 2.0 busy")  # the old window's (idle) ticks unread
    assert slept == [defaults.BUSY_SAMPLE_SECONDS]


def test_without_proc_stat_the_load_average_decides(monkeypatch):
    scripted(monkeypatch, [None, None], load=1.2, cores=4)
    assert defaults.auto_threads() == (3, "auto: 4 cores, load 1.2")


def test_cpu_times_reads_this_machine():
    times = defaults.cpu_times()
    if times is not None:  # Linux
        total, idle = times
        assert total >= idle >= 0


def test_a_launchers_thread_count_is_set_not_only_read_at_torchs_start(monkeypatch):
    """OMP_NUM_THREADS sets torch's threads for every session of a process: torch reads it once, at
    its start, and an earlier session's count (or a variable set later) would stand instead. A value
    that is no count falls back to the cores free."""
    import torch

    from triforce.runtime import session

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert session._set_threads(None) == "OMP_NUM_THREADS" and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2,1")  # nested levels: the first is ours
        assert session._set_threads(None) == "OMP_NUM_THREADS" and torch.get_num_threads() == 2
        monkeypatch.setattr(session, "auto_threads", lambda: (1, "auto"))
        monkeypatch.setenv("OMP_NUM_THREADS", "many")
        assert session._set_threads(None) == "auto" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
