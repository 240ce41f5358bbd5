"""The CPU kernels' pool of threads (triforce/model/cpu_pool.py): every task once, by whichever thread
is free; a task's error reaches the caller; two callers at once, a forked child and either OpenMP
wait policy compute what one thread does; few-row passes keep torch's own ops on one thread."""
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from triforce.model import cpu_pool, decode_attention, decode_attention_f32, stored_bf16

pytestmark = pytest.mark.skipif(not cpu_pool.address(), reason="the pool does not build here (no C++ compiler)")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_every_task_runs_once(threads):
    for tasks in (1, 2, 3, 7, 64, 257):
        for _ in range(20):
            ran_by = torch.ops.triforce_pool.spread(tasks, threads, 0)
            assert ran_by.min() >= 0 and ran_by.max() < threads, ran_by  # ran, by one of the call's threads


def test_a_helper_takes_tasks():
    """Tasks long enough to outlast a helper's wake: it takes some of them (within 20 calls, even on
    a loaded machine: 32 tasks of 0.3 ms give it ~10 ms a call to be scheduled)."""
    took = [int((torch.ops.triforce_pool.spread(32, 2, 300) == 1).sum()) for _ in range(20)]
    assert max(took) > 0, took
    assert torch.ops.triforce_pool.helpers() >= 1


def test_a_task_error_reaches_the_caller_and_the_pool_goes_on():
    for failing in (0, 5, 31):  # the caller's first task, one in the middle (any thread's), the last
        with pytest.raises(RuntimeError, match=f"task {failing} failed"):
            torch.ops.triforce_pool.spread(32, 2, 50, failing)
    assert torch.ops.triforce_pool.spread(16, 2, 0).min() >= 0


def _records(N: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g)
    d, m = (torch.rand(N, K // 32, generator=g).half() for _ in range(2))
    return stored_bf16.q4_records(codes, d, m), torch.randn(3, K, generator=g).bfloat16()


def _product(records, x, N: int, threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return stored_bf16.q4_product(x, records, N)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not stored_bf16.available(), reason="the CPU lacks avx512_bf16")
def test_two_callers_at_once_compute_what_one_thread_does():
    """A second Python thread that calls a kernel while the pool serves the first runs its call alone
    (torch releases the GIL inside ops, so the calls overlap): both get one thread's bits."""
    N = 8192
    records, x = _records(N, 576, 0)
    want = _product(records, x, N, 1)
    wrong = []

    def call():
        for _ in range(100):
            if not torch.equal(stored_bf16.q4_product(x, records, N), want):
                wrong.append(1)

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's count is the process's: both callers see it
    try:
        callers = [threading.Thread(target=call) for _ in range(2)]
        for c in callers:
            c.start()
        for c in callers:
            c.join()
    finally:
        torch.set_num_threads(before)
    assert not wrong


def _in_child(queue, records, x, N):
    # torch's own ops on one thread: a forked child's first OpenMP region can hang where the parent
    # used OpenMP's threads (libgomp is not fork-safe), which is not what this test is about
    torch.set_num_threads(1)
    torch.ops.triforce_pool.set_threads(2)
    got = stored_bf16.q4_product(x, records, N)
    helped = max(int((torch.ops.triforce_pool.spread(32, 2, 300) == 1).sum()) for _ in range(20))
    queue.put((helped, got.view(torch.int16).numpy().tobytes()))


@pytest.mark.skipif(not stored_bf16.available(), reason="the CPU lacks avx512_bf16")
def test_a_forked_child_starts_a_pool_of_its_own():
    """A child forked after the pool started has none of its threads: its first call starts new ones
    (with the parent's pool it would count a helper that does not exist, and run every call alone)."""
    N = 8192
    records, x = _records(N, 576, 0)
    want = _product(records, x, N, 1)
    torch.ops.triforce_pool.spread(64, 2, 20)  # the parent's helper exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(queue, records, x, N))  # forked: nothing pickled
    child.start()
    try:
        helped, got = queue.get(timeout=120)
    finally:
        child.join(timeout=60)
        if child.exitcode is None:
            child.kill()
    assert child.exitcode == 0
    assert helped > 0 and got == want.view(torch.int16).numpy().tobytes()


def test_few_row_passes_keep_torchs_ops_on_one_thread():
    """Inside kernels_threaded torch runs on one thread and the pool on the threads torch had; after
    it (an error included) both are as before."""
    torch.ops.triforce_pool.set_threads(0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu_pool.kernels_threaded():
            assert (torch.get_num_threads(), torch.ops.triforce_pool.threads()) == (1, 2)
        assert (torch.get_num_threads(), torch.ops.triforce_pool.threads()) == (2, 2)
        with pytest.raises(KeyError), cpu_pool.kernels_threaded():
            raise KeyError
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert torch.ops.triforce_pool.threads() == 1  # the pool follows torch's count again
    finally:
        torch.set_num_threads(before)


POLICY_CHECK = r"""
import hashlib, torch
from triforce.model import decode_attention, decode_attention_f32, stored_bf16
from triforce.model.stored import packed_from_blocks
from tests.model.test_stored import random_blocks
digest = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    h = hashlib.sha256()
    for S, R in ((4097, 3), (16384, 3), (4097, 21)):
        keys, values = (torch.randn(3, S, 64, generator=torch.Generator().manual_seed(S)) for _ in range(2))
        rows = torch.randn(3, R, 64, generator=torch.Generator().manual_seed(R))
        limits = torch.tensor([S])
        if decode_attention.available():
            h.update(decode_attention.attend(rows.bfloat16(), keys.bfloat16(), values.bfloat16(), limits, 0.125).view(torch.int16).numpy().tobytes())
        if decode_attention_f32.available():
            h.update(decode_attention_f32.attend(rows, keys.half(), values.half(), limits, 0.125).numpy().tobytes())
    if stored_bf16.available():
        for n in (576, 49152):  # a layer's product, the head's
            layer = packed_from_blocks(random_blocks("Q8_0", n, 576, seed=n), torch.bfloat16)
            h.update(layer(torch.randn(1, 576, generator=torch.Generator().manual_seed(1)).bfloat16()).view(torch.int16).numpy().tobytes())
    digest.append(h.hexdigest())
print(" ".join(digest))
"""


@pytest.mark.skipif(not (decode_attention.available() or decode_attention_f32.available()),
                    reason="no attention kernel of ours here")
def test_either_wait_policy_gives_the_bits_of_one_thread():
    """OpenMP's wait policy (the command line sets PASSIVE) changes how torch's own threads wait, not
    the kernels' bits: one and two threads, each policy in its own process (libgomp reads it at load)."""
    digests = []
    for policy in ("PASSIVE", "ACTIVE"):
        proc = subprocess.run([sys.executable, "-c", POLICY_CHECK], cwd=ROOT, capture_output=True, text=True,
                              timeout=600, env={**os.environ, "OMP_WAIT_POLICY": policy})
        assert proc.returncode == 0, proc.stderr[-2000:]
        digests += proc.stdout.split()
    assert len(digests) == 4 and len(set(digests)) == 1, digests


@pytest.mark.skipif(not stored_bf16.available(), reason="no bf16 kernels over stored blocks")
def test_decoding_runs_torchs_ops_on_one_thread_and_the_kernels_on_the_pool(tmp_path):
    """The engine's decode loop on our products: every pass of a few rows sees torch on one thread
    and the pool on the run's two; the prompt's pass sees torch's two; after the run both are as
    before, and the tokens are those of a run on one thread."""
    from tests.model.test_decode_attention_bf16 import GQA_CFG
    from tests.model.test_stored import write_tiny_gguf
    from triforce.model.gguf_loader import load_gguf_model
    from triforce.speculative import GenerationConfig, Models, generate_ids

    write_tiny_gguf(tmp_path / "tiny.gguf", seed=4, cfg=GQA_CFG)
    target = load_gguf_model(tmp_path / "tiny.gguf", torch.bfloat16, stored=True)
    assert target.products_ours()
    seen = []
    target.embed.register_forward_hook(lambda m, args, out: seen.append(
        (args[0].shape[0], torch.get_num_threads(), torch.ops.triforce_pool.threads())))
    ids = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = GenerationConfig(max_new_tokens=24, budget=64, chunk_size=8, gamma1=3, gamma2=5, draft_window=32,
                           sink_tokens=4, prefill_chunk=256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = generate_ids(Models(target, None), ids, "retrieval", cfg).tokens
        torch.set_num_threads(2)
        seen.clear()
        two = generate_ids(Models(target, None), ids, "retrieval", cfg).tokens
        assert (torch.get_num_threads(), torch.ops.triforce_pool.threads()) == (2, 2)
    finally:
        torch.set_num_threads(before)
    assert two == one
    few = [(t, p) for rows, t, p in seen if rows <= 31]
    assert len(few) > 10 and set(few) == {(1, 2)}, seen
    assert {(t, p) for rows, t, p in seen if rows > 31} == {(2, 2)}, seen
