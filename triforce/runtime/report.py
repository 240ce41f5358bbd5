"""Figures derived from a run's statistics: milliseconds per pass of each level, and the link floor
of an offloaded full cache (the KV it streamed over the measured pinned host->device bandwidth)."""
from __future__ import annotations

import time


def level_ms_per_pass(stats: dict) -> dict:
    """{level: milliseconds per pass} of the levels whose passes were timed, from Stats.to_dict()
    (passes inside a whole drafter->middle round have the round's time, not their own)."""
    timed = stats.get("timed_passes", stats["passes"])
    return {lv: 1e3 * stats["seconds"][lv] / n for lv, n in timed.items() if n}


_BANDWIDTH: dict = {}


def pinned_h2d_bandwidth(device, nbytes: int = 256 * 2**20, repeats: int = 5) -> float | None:
    """Bytes/s of pinned host->device copies, measured once per process and device (a short copy
    benchmark); None off CUDA, where host and device memory are one and there is no link."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    key = str(device)
    if key not in _BANDWIDTH:
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst.copy_(src)  # the first copy pays for lazy setup, not the link
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        _BANDWIDTH[key] = nbytes * repeats / (time.perf_counter() - start)
    return _BANDWIDTH[key]


def link_floor(stats: dict, device, bandwidth: float | None = None) -> dict | None:
    """The least time an offloaded full pass can take: the KV bytes it streamed (measured, decode
    only) over the pinned host->device bandwidth. None without a counted offloaded cache; on CPU
    the floor is n/a (with the reason), the bytes still given."""
    moved, passes = stats.get("bytes_moved"), stats["passes"].get("verify", 0)
    if moved is None or not passes:
        return None
    per_pass = moved / passes
    bandwidth = bandwidth if bandwidth is not None else pinned_h2d_bandwidth(device)
    mib = f"{per_pass / 2**20:,.1f} MiB KV/pass"
    if bandwidth is None:
        return {"kv_bytes_per_full_pass": per_pass, "h2d_bytes_per_second": None, "ms_per_full_pass": None,
                "ms_per_token": None, "text": f"n/a on {torch_device_type(device)}: no host-device link; {mib}"}
    ms = 1e3 * per_pass / bandwidth
    per_token = ms / stats["tokens_per_full_pass"] if stats.get("tokens_per_full_pass") else None
    return {"kv_bytes_per_full_pass": per_pass, "h2d_bytes_per_second": bandwidth, "ms_per_full_pass": ms,
            "ms_per_token": per_token, "text": f"{ms:.1f} ms = {mib} / {bandwidth / 1e9:.1f} GB/s pinned H2D"}


def torch_device_type(device) -> str:
    return str(device).split(":")[0].upper()


def versus_plain(stats: dict, mode: str) -> dict | None:
    """How the run compares with plain (autoregressive) decoding: its measured ms per token against
    plain decoding's, itself predicted by an adaptive run's chooser from the full passes it timed
    in this run (a full pass of one token is what plain decoding pays per token). None when the run
    decoded nothing or has nothing to compare with (a fixed mode other than autoregressive)."""
    tokens, seconds = stats.get("decode_tokens"), stats.get("decode_seconds")
    if not tokens or not seconds:
        return None
    measured = 1e3 * seconds / tokens
    if mode == "autoregressive" and not stats.get("modes"):
        return {"speedup": 1.0, "ms_per_token": measured, "plain_ms_per_token": measured, "how": "this is plain decoding"}
    plain = stats.get("estimates", {}).get("autoregressive")
    if plain is None:
        return None
    return {"speedup": plain["ms_per_token"] / measured, "ms_per_token": measured,
            "plain_ms_per_token": plain["ms_per_token"], "how": "plain decoding predicted from this run's full passes"}
