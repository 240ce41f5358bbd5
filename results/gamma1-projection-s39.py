"""Triforce at gamma1 1 against 4 on the H200 (SmolLM2-135M, 32K, KV in host memory), projected from
sessions 36-37's measured rows: what one draft a round would make, by the arithmetic of
runtime/settings.py SELF_DRAFT_GPU_GAMMA1. A projection, not a measurement: the next lease runs both
(bench system triforce-gamma1-4 beside triforce).

    python results/gamma1-projection-s39.py

A round's parts, from two rows of one run (results/gpu-2026-11-27-h200-d.json, gamma2 6): a round of
4 SmolLM2 drafts and the middle level's check (draft+middle) against a round whose 4 drafts were
looked up (no pass): the second is the middle level's part, the difference 4 drafter passes."""
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent


def rows(name: str, step: str) -> dict:
    data = json.loads((RESULTS / name).read_text())
    found = next(s for s in data["steps"] if s["name"] == step)["result"]["rows"]
    return {r["system"]: r for r in found if r["context"] == 32768}


def main() -> None:
    greedy, looked_up = rows("gpu-2026-11-27-h200-d.json", "kv host greedy"), rows("gpu-2026-11-27-h200-d.json", "lookup kv host greedy")
    middle = looked_up["triforce"]["ms_per_pass"]["draft+middle"]  # 4 looked-up drafts: the middle's part of a round
    drafter = (greedy["triforce"]["ms_per_pass"]["draft+middle"] - middle) / 4
    print(f"a round's middle part {middle:.2f} ms, a drafter pass {drafter:.2f} ms (4 drafts a round, gamma2 6)")
    for label, name, step in (("sampled 0.8, gamma2 6", "gpu-2026-11-27-h200-d.json", "kv host sampled"),
                              ("greedy, gamma2 6", "gpu-2026-11-27-h200-d.json", "kv host greedy"),
                              ("sampled 0.8, gamma2 16", "gpu-2026-11-27-h200-f.json", "gamma2 16 kv host sampled")):
        r = rows(name, step)
        tri, plain = r["triforce"], r["autoregressive"]
        gamma2, a = tri["gamma2"], tri["acceptance"]["draft->middle"]
        verify, full_passes = tri["ms_per_pass"]["verify"], tri["passes"]["verify"]
        rounds = tri["passes"]["draft+middle"] / full_passes  # measured rounds a full pass, 4 drafts each
        made = tri["tokens_per_full_pass"]
        measured = made / (rounds * tri["ms_per_pass"]["draft+middle"] + verify) * 1000
        print(f"\n{label}: drafter acceptance {a:.2f}; plain decoding {plain['tokens_per_second']:.1f} tok/s; "
              f"triforce at gamma1 4 measured {tri['tokens_per_second']:.1f} ({tri['tokens_per_second'] / plain['tokens_per_second']:.2f}x), "
              f"its rounds' arithmetic {measured:.1f}")
        # what 4 drafts a round made a round, from the rounds it took to make gamma2 middle tokens; one
        # draft makes 1 + s_1 of them, s_1 at least the edge's rate and at most that round's 4-draft yield - 1
        per_round = gamma2 / rounds
        for s1 in sorted({a, min(max(per_round - 1, a), 1.0)}):
            R = math.ceil(gamma2 / (1 + s1) - 1e-9)
            seconds = R * (drafter + middle) + verify
            tps = made / seconds * 1000
            print(f"  gamma1 1 at s_1 {s1:.2f}: {R} rounds a full pass, {seconds:.1f} ms for {made:.2f} tokens: "
                  f"{tps:.1f} tok/s ({tps / plain['tokens_per_second']:.2f}x plain decoding)")


if __name__ == "__main__":
    main()
