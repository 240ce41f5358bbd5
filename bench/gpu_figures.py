"""Every GPU figure of issue 15 with one command (issue 22), the most needed first, so that a lease that
cannot hold the whole plan (15 minutes of device time, each step about 1-3 minutes) still gets them:

    python -m bench.gpu_figures --out results/gpu-<date>.json

SmolLM2-135M (models/smollm2-135m) at 4K and 32K tokens, bfloat16, with the KV on the GPU and in host
memory (--offload host), all four modes greedy and sampled, beside transformers' static and offloaded
caches (bench.bench, which also checks greedy tokens against our autoregressive engine); the pinned
host-to-device link floor (bench.linkbench / bench.measure); float32 greedy equality with the KV in
host memory (bench.bench fails on a mismatch); CUDA-graph tokens equal to eager ones (tests/gpu); last,
compiled passes beside uncompiled ones and the kernels per layer inside each level's graph; and the
method's own regime, Llama-2-7B's shape drafted by llama-68m's on random weights, each level's pass
measured and each mode projected from those costs (bench.big_target).
Each step runs the existing tool as its own process, so one failing step leaves the others' figures;
the JSON holds every step's command, exit status, seconds and results, and is rewritten after every
step, so a call stopped at its limit still returns what was done. A lent machine's time is short:
`--deadline S` gives the whole plan S seconds (each step's limit shrinks to what is left, a step with
too little left is recorded as skipped), and `--only`/`--skip` split the plan between calls;
`--call 1`/`--call 2` are the next lease's two (LEASE_CALLS).
Without CUDA it prints one line and exits 2. `--rehearse` runs the same plan on this machine's CPU at
512 and 1,024 tokens (8 new tokens, the model's first 4 layers, the link step on random weights of 2
layers): it proves every step's command runs before device time is spent on it (its figures mean
nothing). Getting the model
onto a lent GPU machine: docs/gpu-session.md.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_stage import staged_book
from triforce.cli.common import run_cli
from triforce.model.errors import UserError
from triforce.model.gguf_loader import MARKER
from triforce.runtime.defaults import MODELS_DIR

# triforce: device rounds on a GPU; adaptive: the default mode, choosing among the others as it measures
OURS = "autoregressive,speculative,retrieval,triforce,triforce-host,adaptive"
MODEL = "models/smollm2-135m"


CONTEXTS, REHEARSAL_CONTEXTS = "4096,32768", "512,1024"
WRITES_JSON = ("bench.bench", "bench.op_forms", "bench.big_target", "bench.verification")  # take --out
SAMPLED_REPEATS = 4  # sampled steps: four 64-token texts a row (seeds 0-3), about 7 s more a step on an H200
# the rehearsal's model: the checkpoint's first layers. All 30 of SmolLM2's made the rehearsal take
# over 15 minutes on a 2-core Xeon without bf16 dot products (its compiled steps over 5 each), and
# depth changes no command line
REHEARSAL_LAYERS = 4
# the steps that need no checkpoint (random weights, tiny models): the first call of a lease runs them
# while the model's second half is on its way (docs/gpu-session.md)
NO_MODEL = "link floor,op forms,op forms llama-3,graph == eager tokens,kernels per layer,big target"
COMPILED_LAW = "compiled_sampled"  # tests/gpu/test_gpu_sampling.py: compiled passes keep the target's law
MIN_STEP_SECONDS = 20  # a step given less than this is skipped rather than started and cut
# the next lease's two calls (docs/gpu-session.md), so that a session with a GPU spends no time
# composing them: (the steps each runs, its deadline in seconds; None: --deadline, what is left).
# Call 1 runs while the model's second half travels: the op forms, tests/gpu (with its sampling law
# cases, which come before every speed figure) and the kernels per layer, never measured on a GPU.
# Call 2: the host-memory regime greedy and sampled, the sampled acceptance beside the CPU's, the float32
# equality check, fixed triforce sampled compiled (the one missed target's lever: its law, then its
# speed; compiling takes minutes, so after the checks), then what earlier leases measured: TriForce's
# published sampling, the timeline, transformers' static cache.
LEASE_CALLS = {
    1: ("op forms,graph == eager tokens,kernels per layer", 310.0),
    2: ("kv host greedy,kv host sampled,verification kv host sampled,float32 greedy equality (kv host),"
        "compiled sampling law,compiled kv host sampled,published sampling kv host,timeline kv host,kv gpu greedy", None),
}  # each call runs its steps in this order (transformers' static cache compiles for minutes: last)


def steps(model: str, new_tokens: int, rehearse: bool = False, prompt_file: str | None = None) -> list[tuple[str, list[str]]]:
    """(name, argv after `python -m`) of every measurement, those the targets of issue 22 need most
    first (the KV in host memory is the product's regime); rehearsed, the same plan at sizes a CPU
    runs in seconds."""
    contexts = REHEARSAL_CONTEXTS if rehearse else CONTEXTS
    def bench_with(draft: str) -> list[str]:
        return ["bench.bench", "--model", model, "--new-tokens", str(new_tokens), "--repeats", "1", "--draft", draft,
                *(["--prompt-file", prompt_file] if prompt_file else [])]

    bench = bench_with("self")
    link = ["--context", "1024", "--layers", "2", "--device", "cpu"] if rehearse else ["--context", "32768", "--layers", "30"]
    out = []
    # each op's form beside the form before (attention: which fused kernels take it; the norm), at
    # SmolLM2's and Llama-3-8B's widths
    forms = ["bench.op_forms", *(["--device", "cpu"] if rehearse else [])]
    out.append(("op forms", forms))
    out.append(("op forms llama-3", [*forms, "--heads", "32,8", "--head-dim", "128", "--hidden", "4096"]))
    # sampled: temperature 0.8 over the whole vocabulary (top-p 1, bench.bench's default, said aloud),
    # each timed repetition another seed, pooled (a later --repeats wins over bench_with's): one 64-token
    # text a row, as until session 54, moved triforce's acceptance at 32K by more than the changes it judged
    greedy, sampled = ["--accept-ties"], ["--temperature", "0.8", "--top-p", "1.0", "--repeats", str(SAMPLED_REPEATS)]
    # bfloat16 greedy runs may part at logit ties (rounding, which the bench names); the float32 step
    # below is the exact-token check
    # with the KV in host memory the adaptive rows are the steady state (--learned: each timed run goes
    # on from what the warm-up learned); 64 tokens of a fresh chooser are mostly its first tries
    host = [*bench, "--contexts", contexts, "--offload", "host", "--dtype", "bfloat16", "--learned"]
    # the adaptive rows in the steady state here too: a fresh run at 4K spent most of its 64 tokens
    # capturing a graph for each width its first tries used (session 35: 0.20x plain decoding)
    resident = [*bench, "--contexts", contexts, "--offload", "none", "--dtype", "bfloat16", "--learned"]
    # the adaptive default beside the same weighing lookups beside its drafter (the GPU default from
    # session 26 to 39; runtime/settings.py SELF_DRAFT_GPU_LOOKUP says why it weighs none now), and
    # triforce at its GPU default gamma1 (1 with the target drafting for itself since session 39)
    # beside the 4 before, in the host-memory steps (runtime/settings.py SELF_DRAFT_GPU_GAMMA1)
    out.append(("kv host greedy", [*host, "--systems", OURS + ",triforce-gamma1-4,adaptive-lookup,hf-offloaded", *greedy]))
    # SmolLM2 drafting for itself costs what its middle pass costs (~850 kernels each), so a
    # drafter->middle round cannot beat the middle level alone; drafts looked up in the sequence cost
    # a few kernels (speculative/lookup.py): triforce's levels with them, at 32K, greedy and sampled
    longest = contexts.split(",")[-1]
    lookup = [*bench_with("lookup"), "--contexts", longest, "--offload", "host", "--dtype", "bfloat16",
              "--learned", "--systems", "autoregressive,retrieval,speculative,triforce,adaptive"]
    out.append(("lookup kv host greedy", [*lookup, *greedy]))
    # the product's regime sampled before anything that compiles (a 15-minute lease, session 35); with
    # retrieval and triforce verifying one draft at a time beside block verification (session 53)
    out.append(("kv host sampled", [*host, "--systems", OURS + ",triforce-gamma1-4,adaptive-lookup,retrieval-token,triforce-token",
                                    *sampled]))
    out.append(("lookup kv host sampled", [*lookup, *sampled]))
    # transformers' static cache compiles once per context (minutes with both; it ate session 23's
    # lease): after every host-memory step, so that a compile that overruns costs only what follows
    out.append(("kv gpu greedy", [*resident, "--systems", OURS + ",hf-static", *greedy]))
    # the previous GPU default gamma2 (6) with the KV in host memory, beside the default since session
    # 37 (TriForce's offloading 16, runtime/settings.py OFFLOADED_GAMMA2) for retrieval and the
    # adaptive default, whose chooser prices every gamma up to it: session 37 measured 16 in one lease
    # and 6 in another, so the next lease runs both side by side (fixed triforce keeps 6)
    short_gamma = [*bench, "--contexts", longest, "--offload", "host", "--dtype", "bfloat16", "--learned",
                   "--gamma2", "6", "--systems", "autoregressive,retrieval,adaptive"]
    out.append(("gamma2 6 kv host greedy", [*short_gamma, *greedy]))
    out.append(("gamma2 6 kv host sampled", [*short_gamma, *sampled]))
    # sampled as TriForce's paper measured (temperature 0.6, top-p 0.9, gamma 16 offloaded), where the
    # steps above sample at 0.8 over the whole vocabulary: triforce sampled missed 2x at 0.8 (1.40x
    # at gamma2 6, 0.81x at 16; its SmolLM2 drafter accepted 0.16-0.18 at 32K), so this tells the
    # engine from the setting
    published = [*bench, "--contexts", longest, "--offload", "host", "--dtype", "bfloat16", "--learned",
                 "--gamma2", "16", "--systems", "autoregressive,retrieval,triforce,triforce-gamma1-4,adaptive"]
    out.append(("published sampling kv host", [*published, "--temperature", "0.6", "--top-p", "0.9",
                                                "--repeats", str(SAMPLED_REPEATS)]))
    # the sampled acceptance at 32K against the CPU's in the same settings (session 54's page: the
    # story of Moby Dick, top-p 1, triforce gamma1 1 gamma2 6 budget 8,192, 0.63-0.70 in float32 on
    # CPU, where session 40's H200 row stood at 0.55 after the licence): 4 seeds of 96 tokens, each
    # full verification's expected kept drafts by both rules (bench/verification.py), about a minute
    verify_context = str(int(longest) - 64)  # + 96 new tokens: the CPU runs' YaRN factor (4.25 at 32K)
    out.append(("verification kv host sampled", [
        "bench.verification", "--model", model, "--draft", "self", *(["--prompt-file", prompt_file] if prompt_file else []),
        "--context", verify_context, "--offload", "host", "--dtype", "bfloat16", "--modes", "retrieval,triforce",
        "--gamma1", "1", "--gamma2", "6", "--budget", "8192" if not rehearse else "256", "--seeds", "4",
        "--new-tokens", "96" if not rehearse else "8", "--top-p", "1.0"]))
    # where the time goes (bench/timeline.py: kernels, copies, their overlap, the device idle): plain
    # decoding in host memory at 4K ran 1.36x its link floor a token, the pass alone 1.27x (session
    # 36), and the adaptive default spent 0.2-0.6 ms a token more than its passes' sum (session 37)
    # plain decoding queued ahead (the GPU default since session 38, the adaptive default's plain
    # passes since 39) beside one pass at a time
    timeline = ["--systems", "autoregressive,autoregressive-waiting,adaptive,adaptive-waiting", "--timeline"]
    out.append(("timeline kv host", [*host, *timeline, *greedy]))
    out.append(("timeline kv gpu", [*resident, *timeline, *sampled]))
    # fewer kernels a pass (issue 22 item 5) where the targets are missed: the proposing levels'
    # passes compiled with the KV in host memory at 32K (the full level's offloaded pass is captured,
    # never compiled), beside the same modes uncompiled in one run
    compiled_host = [*bench, "--contexts", longest, "--offload", "host", "--dtype", "bfloat16", "--systems"]
    out.append(("compiled kv host greedy", [
        *compiled_host, "autoregressive,retrieval,retrieval-compiled,triforce,triforce-compiled,adaptive-compiled",
        *greedy]))
    # sampled, where the proposing levels' passes weigh most: fixed triforce (issue 22's one missed
    # target, 1.52x against 2x in session 40) beside itself compiled, after the law its tokens must
    # keep. Session 37's compiled greedy step cut a middle pass 1.63 -> 1.17 ms and a drafter->middle
    # round 9.6 -> 7.2 ms; at session 40's sampled costs (a 14.2 ms full pass, four 5.2 ms rounds a
    # pass) that projects 1.52x -> about 1.8x. Fixed triforce alone: a compiled system compiles for a
    # minute or more on CUDA, and a step the lease's deadline cuts leaves no row (retrieval meets its
    # targets). Inductor's on-disk cache serves what an earlier compiled step compiled
    out.append(("compiled sampling law", ["pytest", "-q", "tests/gpu/test_gpu_sampling.py", "-k", f"{COMPILED_LAW} and triforce"]))
    out.append(("compiled kv host sampled", [*compiled_host, "autoregressive,triforce,triforce-compiled", *sampled]))
    out.append(("kv gpu sampled", [*resident, "--systems", OURS, *sampled]))
    # both contexts: at 32K bfloat16 passes of 1 and of 2-7 tokens part by more than the bench's tie
    # bound (session 23's H200 run); float32 is the exact check there too
    out.append(("float32 greedy equality (kv host)",
                [*bench, "--contexts", contexts, "--offload", "host", "--dtype", "float32", "--systems", OURS]))
    # the compiled sampling law compiles on CUDA for a minute or two: its own step, in call 2 right
    # before the compiled speed it vouches for, so that call 1 keeps its time for the kernels per layer
    out.append(("graph == eager tokens", ["pytest", "-q", "tests/gpu", "-k", f"not {COMPILED_LAW}"]))
    # torch.compile on CUDA costs tens of seconds a shape: plain decoding's pass with the KV on the GPU
    first = contexts.split(",")[0]
    out.append(("compiled kv gpu greedy", [*bench, "--contexts", first, "--offload", "none", "--dtype", "bfloat16",
                                            "--systems", "autoregressive,autoregressive-compiled", *greedy]))
    # CUDA kernels per layer inside each level's captured graph, eager and compiled (random tiny models);
    # rehearsed eager only (compiling its six passes on a CPU takes minutes and proves no command line)
    out.append(("kernels per layer", ["bench.kernels", *(["--eager-only"] if rehearse else [])]))
    # the method's own regime, which SmolLM2 drafting for itself cannot show: Llama-2-7B's shape with
    # llama-68m's as the drafter, random weights, 32K tokens of KV in host memory; each level's pass
    # measured through the engine, each mode projected from those costs at given acceptance rates.
    # Model-free, so the first call runs it, last there (its length is not known yet: the steps
    # measured before keep their time)
    out.append(("big target", ["bench.big_target", *(["--rehearse"] if rehearse else [])]))
    # last of the first call: each bench row already carries its own link floor (the pinned copy rate
    # beside its bytes a pass), so this 7B-wide streaming check is what a short lease can lose
    out.append(("link floor", ["bench.linkbench", "--tokens", "1", "7", *link]))
    return out


def rehearsal_model(folder: str | Path, scratch: Path) -> Path:
    """The model's folder with its config cut to its first REHEARSAL_LAYERS layers (the loader reads
    only the layers the config names): its files linked, not copied, and no GGUF marker, so it loads
    the folder's dense weights. A folder without a config is returned as it is: the steps that read
    the model then say it is missing, and those that need none still rehearse."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return folder
    out = scratch / "rehearsal-model" / folder.name
    out.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file() and f.name not in ("config.json", MARKER):
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = min(REHEARSAL_LAYERS, config["num_hidden_layers"])
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def run_step(name: str, argv: list[str], scratch: Path, timeout: float) -> dict:
    """One tool in its own process; a bench step's --out JSON (or a tool's JSON lines) is kept."""
    out_file = scratch / (name.replace(" ", "-").replace("=", "eq") + ".json")
    command = [sys.executable, "-m", *argv] + (["--out", str(out_file)] if argv[0] in WRITES_JSON else [])
    print(f"[gpu_figures] {name}: {' '.join(command[2:])}", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:  # its output comes as bytes, text=True or not
        code, stdout, stderr = "timeout", as_text(e.stdout), as_text(e.stderr)
    seconds = time.perf_counter() - start
    result = json.loads(out_file.read_text()) if out_file.exists() else json_lines(stdout)
    print(f"[gpu_figures] {name}: exit {code} in {seconds:.0f} s", flush=True)
    return {"name": name, "command": command[2:], "exit": code, "seconds": seconds, "result": result,
            "tail": kept_output(stdout + stderr, failed=code != 0)}


# a failed step keeps its first lines (the error) and its last ones; between them a CUDA error's
# teardown repeats one warning per event, each with its own timestamp (the first H200 run of
# bench.big_target kept 8,000 characters of "device-side assert triggered (function ~CUDAEvent)")
HEAD_CHARS, TAIL_CHARS, OK_TAIL_CHARS = 4000, 4000, 2000
_STAMP = re.compile(r"^\[[WEI]\d{4} [\d:.]+ ")


def kept_output(text: str, failed: bool) -> str:
    """What the JSON keeps of a step's output: the tail of a step that passed; of a failed one, the
    head and the tail, runs of a repeated line (timestamps aside) folded into one with a count."""
    if not failed:
        return text[-OK_TAIL_CHARS:]
    lines: list[str] = []
    last, repeats = None, 0
    for line in text.splitlines():
        same = _STAMP.sub("", line)
        if same == last:
            repeats += 1
            continue
        if repeats:
            lines.append(f"[... the line above {repeats} more times]")
        lines.append(line)
        last, repeats = same, 0
    if repeats:
        lines.append(f"[... the line above {repeats} more times]")
    folded = "\n".join(lines)
    if len(folded) <= HEAD_CHARS + TAIL_CHARS:
        return folded
    return folded[:HEAD_CHARS] + "\n[...]\n" + folded[-TAIL_CHARS:]


def as_text(out) -> str:
    """A child's output as text: subprocess hands a timed-out child's output over as bytes (the first
    H200 run lost every later step to a TypeError here)."""
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def chosen(plan: list[tuple[str, list[str]]], only: str | None, skip: str | None,
           listed_order: bool = False) -> list[tuple[str, list[str]]]:
    """The plan's steps named by --only (all by default) less those named by --skip (comma-separated),
    in the plan's order, or (listed_order) in --only's."""
    names = [n for n, _ in plan]
    picked = {}
    for flag, value in (("--only", only), ("--skip", skip)):
        picked[flag] = [n.strip() for n in value.split(",") if n.strip()] if value else []
        unknown = [n for n in picked[flag] if n not in names]
        if unknown:
            raise UserError(f"{flag}: no step named {', '.join(map(repr, unknown))}; the steps are {', '.join(names)}")
    kept = [(n, a) for n, a in plan if (not picked["--only"] or n in picked["--only"]) and n not in picked["--skip"]]
    return sorted(kept, key=lambda step: picked["--only"].index(step[0])) if listed_order else kept


def json_lines(text: str) -> list:
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_figures", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="the JSON (default results/gpu-<date>.json; rehearsed bench-out/gpu-rehearsal.json)")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--prompt-file", help="the bench steps' book (default: the one `bench.gpu_stage pack` staged, "
                   "else the bench's own, whose 18.9K tokens skip the 32K contexts)")
    p.add_argument("--new-tokens", type=int, help="tokens each run decodes (default 64; rehearsed 8)")
    p.add_argument("--rehearse", action="store_true",
                   help="run the plan on this CPU at small sizes to prove every step runs (figures mean nothing)")
    p.add_argument("--step-timeout", type=float, default=300.0, help="seconds before a step is abandoned")
    p.add_argument("--deadline", type=float, help="seconds for the whole plan (default: no limit but each step's)")
    p.add_argument("--only", help="comma-separated step names to run (default: all)")
    p.add_argument("--skip", help="comma-separated step names to leave out")
    p.add_argument("--call", type=int, choices=sorted(LEASE_CALLS),
                   help="the next lease's call 1 or 2 (LEASE_CALLS: its steps, and call 1's deadline unless --deadline)")
    args = p.parse_args(argv)
    if args.call is not None:
        if args.only or args.skip:
            raise UserError("--call names its own steps; drop --only/--skip, or drop --call")
        args.only, deadline = LEASE_CALLS[args.call]
        args.deadline = args.deadline if args.deadline is not None else deadline
    new_tokens = args.new_tokens or (8 if args.rehearse else 64)
    staged = staged_book(MODELS_DIR)
    prompt_file = args.prompt_file or (str(staged) if staged.is_file() else None)
    plan = chosen(steps(args.model, new_tokens, args.rehearse, prompt_file), args.only, args.skip, args.call is not None)
    if not plan:
        raise UserError("--only/--skip left no step to run")
    import torch

    if not torch.cuda.is_available() and not args.rehearse:
        print("needs a CUDA GPU")
        return 2
    out = Path(args.out or ("bench-out/gpu-rehearsal.json" if args.rehearse else f"results/gpu-{time.strftime('%Y-%m-%d')}.json"))
    device = "cpu (rehearsal: the figures mean nothing)" if args.rehearse else torch.cuda.get_device_name(0)
    began = time.perf_counter()
    figures = {"device": device, "model": args.model, "new_tokens": new_tokens, "steps": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        if args.rehearse:
            cut = rehearsal_model(args.model, Path(scratch))
            plan = chosen(steps(str(cut), new_tokens, True, prompt_file), args.only, args.skip, args.call is not None)
            figures["model"] += f" (first {REHEARSAL_LAYERS} layers)" if cut != Path(args.model) else ""
        for name, step_argv in plan:
            left = args.deadline - (time.perf_counter() - began) if args.deadline is not None else args.step_timeout
            if left < MIN_STEP_SECONDS:
                print(f"[gpu_figures] {name}: skipped, {left:.0f} s of the deadline left", flush=True)
                figures["steps"].append({"name": name, "command": step_argv, "exit": "skipped (deadline)",
                                         "seconds": 0.0, "result": [], "tail": ""})
            else:
                figures["steps"].append(run_step(name, step_argv, Path(scratch), min(left, args.step_timeout)))
            figures["seconds"] = time.perf_counter() - began
            out.write_text(json.dumps(figures, indent=1))  # after every step: a stopped call keeps what ran
    failed = [s["name"] for s in figures["steps"] if s["exit"] != 0]
    print(f"wrote {out} in {figures['seconds']:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
