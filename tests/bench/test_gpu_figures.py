"""bench.gpu_figures: one line and exit 2 without CUDA; its plan covers every figure issue 22 names."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_figures


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_figures", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout.strip() == "needs a CUDA GPU" and not done.stderr
    assert not (tmp_path / "x.json").exists()


def test_the_plan_covers_the_figures():
    plan = dict(gpu_figures.steps("m", 64))
    commands = [" ".join(argv) for argv in plan.values()]
    for offload in ("none", "host"):
        runs = [c for c in commands if f"--offload {offload}" in c and "bfloat16" in c and "compiled" not in c
                and "--draft lookup" not in c and "--gamma2" not in c and "--timeline" not in c]
        assert len(runs) == 2 and sum("--temperature" in c for c in runs) == 1
        assert all("4096,32768" in c and gpu_figures.OURS in c for c in runs)
        # the adaptive default beside the same weighing lookups, with the KV in host memory
        assert all(("adaptive-lookup" in c) == (offload == "host") for c in runs)
        assert all("--learned" in c for c in runs)  # the adaptive rows in the steady state
    assert any("hf-static" in c for c in commands) and any("hf-offloaded" in c for c in commands)
    assert any(c.startswith("bench.linkbench") for c in commands)
    assert plan["big target"] == ["bench.big_target"] and "big target" in gpu_figures.NO_MODEL.split(",")
    assert any("float32" in c and "--offload host" in c and "4096,32768" in c for c in commands)
    assert plan["graph == eager tokens"] == ["pytest", "-q", "tests/gpu", "-k", "not compiled_sampled"]
    # the compiled law has its own step, right before the compiled sampled speed it vouches for
    names = list(plan)
    assert names.index("compiled sampling law") + 1 == names.index("compiled kv host sampled")
    assert plan["compiled sampling law"][-2:] == ["-k", "compiled_sampled and triforce"]
    # the previous default gamma2 beside the offloaded default (16), greedy and sampled, at 32K in host memory
    short_gamma = [" ".join(plan[f"gamma2 6 kv host {s}"]) for s in ("greedy", "sampled")]
    assert all("--gamma2 6" in c and "--contexts 32768 --offload host" in c and "adaptive" in c for c in short_gamma)
    assert "--temperature" in short_gamma[1] and "--temperature" not in short_gamma[0]
    assert "autoregressive,autoregressive-compiled" in " ".join(plan["compiled kv gpu greedy"])
    compiled_host = " ".join(plan["compiled kv host greedy"])
    assert "--contexts 32768 --offload host" in compiled_host and all(
        s in compiled_host.split("--systems ")[1].split()[0].split(",") for s in
        ("autoregressive", "retrieval", "retrieval-compiled", "triforce-compiled", "adaptive-compiled"))
    compiled_sampled = " ".join(plan["compiled kv host sampled"])
    assert "--temperature 0.8" in compiled_sampled and "--contexts 32768 --offload host" in compiled_sampled
    # the missed target (fixed triforce sampled, KV in host memory) beside itself compiled
    assert {"autoregressive", "triforce", "triforce-compiled"} <= set(compiled_sampled.split("--systems ")[1].split()[0].split(","))
    # the missing figures first: host greedy (our drafter, then drafts looked up: the triforce target's
    # best chance), then the resident cache against transformers' static one
    assert [n for n in plan][2:14] == ["kv host greedy", "lookup kv host greedy", "kv host sampled", "lookup kv host sampled",
                                    "kv gpu greedy", "gamma2 6 kv host greedy", "gamma2 6 kv host sampled",
                                    "published sampling kv host", "verification kv host sampled", "timeline kv host",
                                    "timeline kv gpu", "compiled kv host greedy"]
    # sampled rows pool four seeds at an explicit top-p; the CPU's acceptance at 32K, measured on the GPU
    for step in ("kv host sampled", "lookup kv host sampled", "gamma2 6 kv host sampled", "published sampling kv host"):
        argv = plan[step]
        assert argv[len(argv) - 1 - argv[::-1].index("--repeats") + 1] == str(gpu_figures.SAMPLED_REPEATS) == "4", step
    assert "--top-p 1.0" in " ".join(plan["kv host sampled"])
    verification = " ".join(plan["verification kv host sampled"])
    assert verification.startswith("bench.verification") and "bench.verification" in gpu_figures.WRITES_JSON
    assert all(flag in verification for flag in ("--context 32704", "--offload host", "--dtype bfloat16", "--budget 8192",
                                                  "--gamma1 1 --gamma2 6", "--seeds 4", "--new-tokens 96", "--top-p 1.0"))
    # sampled as TriForce's paper did, gamma 16 for every system
    published = " ".join(plan["published sampling kv host"])
    assert "--temperature 0.6 --top-p 0.9" in published and "--gamma2 16" in published and "triforce" in published
    # triforce at its default gamma1 beside 4, the default before, in the host-memory steps
    assert all("triforce-gamma1-4" in " ".join(plan[s]) for s in ("kv host greedy", "kv host sampled",
                                                                   "published sampling kv host"))
    # block verification beside one draft at a time, sampled with the KV in host memory (session 53)
    sampled_systems = " ".join(plan["kv host sampled"]).split("--systems ")[1].split()[0].split(",")
    assert {"retrieval", "retrieval-token", "triforce", "triforce-token"} <= set(sampled_systems)
    assert all("--timeline" in plan[f"timeline kv {w}"] for w in ("host", "gpu"))
    # plain decoding queued ahead beside one pass at a time, in one run
    assert all("autoregressive,autoregressive-waiting,adaptive,adaptive-waiting" in " ".join(plan[f"timeline kv {w}"])
               for w in ("host", "gpu"))
    for name, flags in (("lookup kv host greedy", "--accept-ties"), ("lookup kv host sampled", "--temperature 0.8")):
        line = " ".join(plan[name])
        assert "--draft lookup" in line and "--contexts 32768 --offload host" in line and flags in line
    assert [n for n in plan][-4:-2] == ["compiled kv gpu greedy", "kernels per layer"]  # compiling is slow: late
    assert [n for n in plan][-2:] == ["big target", "link floor"]
    assert plan["kernels per layer"] == ["bench.kernels"]
    assert not any("," in name for name in plan)  # --only and --skip take comma-separated names
    # the op forms need no model: they run beside the link floor, before the model arrives
    assert plan["op forms"] == ["bench.op_forms"]
    assert plan["op forms llama-3"] == ["bench.op_forms", "--heads", "32,8", "--head-dim", "128", "--hidden", "4096"]


def test_the_op_forms_step_writes_its_rows(tmp_path):
    """Rehearsed on CPU: both forms of each op agree, every shape has a row, the JSON says the device."""
    out = tmp_path / "forms.json"
    done = subprocess.run([sys.executable, "-m", "bench.op_forms", "--device", "cpu", "--repeats", "3",
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu" and [(r["op"], r["T"]) for r in figures["rows"]] == [
        ("attention decode", 1), ("attention decode", 2), ("attention decode", 7), ("attention prefill", 64),
        ("rmsnorm", 1), ("rmsnorm", 7)]
    # bf16: the norm's one rounding against two is at most one unit apart (~1/128 relative, values ~3)
    assert all(r["max_difference"] < 5e-2 and r["us_ours"] > 0 for r in figures["rows"])
    assert not any(any(r.get("kernels_ours", {}).values()) for r in figures["rows"])  # no CUDA kernel takes CPU tensors


def test_a_rehearsal_keeps_the_plan_and_shrinks_it():
    real, rehearsed = gpu_figures.steps("m", 64), gpu_figures.steps("m", 8, rehearse=True)
    assert [name for name, _ in real] == [name for name, _ in rehearsed]
    for (_, a), (_, b) in zip(real, rehearsed):
        assert a[0] == b[0]
    commands = [" ".join(argv) for _, argv in rehearsed]
    assert not any(gpu_figures.CONTEXTS in c for c in commands)
    assert any("bench.linkbench" in c and "--device cpu" in c for c in commands)


ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "smollm2-135m"


@pytest.mark.slow
@pytest.mark.skipif(not MODEL.is_dir(), reason="models/smollm2-135m missing: run triforce-prepare")
def test_the_rehearsal_runs_every_step(tmp_path):
    """Every step of the GPU plan runs to exit 0 on this CPU at small sizes, so device time is not
    spent finding a broken command line. About 7 minutes on an idle 2-core avx512 Xeon (the limit is
    a hang guard)."""
    out = tmp_path / "rehearsal.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_figures", "--rehearse", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [s["name"] for s in figures["steps"]] == [n for n, _ in gpu_figures.steps("m", 8, rehearse=True)]
    assert all(s["exit"] == 0 for s in figures["steps"])
    benches = [s for s in figures["steps"] if s["command"][0] == "bench.bench"]
    assert benches and all(s["result"] for s in benches)


def test_only_and_skip_split_the_plan_between_calls():
    plan = gpu_figures.steps("m", 64)
    names = [n for n, _ in plan]
    first = gpu_figures.chosen(plan, gpu_figures.NO_MODEL, None)
    rest = gpu_figures.chosen(plan, None, gpu_figures.NO_MODEL)
    # the link floor last: each bench row carries its own, so a short first call loses it first
    assert [n for n, _ in first] == [
        "op forms", "op forms llama-3", "graph == eager tokens", "kernels per layer", "big target", "link floor"]
    assert sorted(n for n, _ in first + rest) == sorted(names)
    assert rest[0][0] == "kv host greedy"  # the product's regime first, so a short lease measures it
    with pytest.raises(gpu_figures.UserError, match="no step named 'kv x'; the steps are op forms"):
        gpu_figures.chosen(plan, "kv x", None)


def test_a_spent_deadline_skips_steps_and_still_writes_the_json(tmp_path):
    out = tmp_path / "x.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_figures", "--rehearse", "--deadline", "0", "--only",
                           "link floor,kv host greedy", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1 and "failed: kv host greedy, link floor" in done.stdout, done.stdout + done.stderr
    steps = json.loads(out.read_text())["steps"]
    assert [(s["name"], s["exit"]) for s in steps] == [("kv host greedy", "skipped (deadline)"),
                                                       ("link floor", "skipped (deadline)")]


@pytest.mark.parametrize("call", [1, 2])
def test_the_next_leases_calls_are_named_steps_in_the_plans_order(tmp_path, call):
    """--call N runs LEASE_CALLS[N]'s steps, which all exist, in the order listed there; call 1 brings
    its own deadline and call 2 takes --deadline (what the lease has left)."""
    out = tmp_path / "x.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_figures", "--rehearse", "--call", str(call), "--deadline", "0",
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr  # every step skipped by the spent deadline
    ran = [s["name"] for s in json.loads(out.read_text())["steps"]]
    listed = gpu_figures.LEASE_CALLS[call][0].split(",")
    assert ran == listed
    assert gpu_figures.LEASE_CALLS[1][1] and gpu_figures.LEASE_CALLS[2][1] is None
    assert set(gpu_figures.LEASE_CALLS[1][0].split(",")) <= set(gpu_figures.NO_MODEL.split(","))  # before the model
    refused = subprocess.run([sys.executable, "-m", "bench.gpu_figures", "--rehearse", "--call", str(call), "--only",
                              "op forms"], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 2 and refused.stderr.strip() == "error: --call names its own steps; drop --only/--skip, or drop --call"


def test_a_bad_step_name_is_one_line():
    done = subprocess.run([sys.executable, "-m", "bench.gpu_figures", "--rehearse", "--only", "nope"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1 and "no step named 'nope'" in done.stderr


def test_a_timed_out_steps_output_is_text():
    assert gpu_figures.as_text(b"rep 1 \xe2\x94\x81") == "rep 1 \u2501"
    assert gpu_figures.as_text(None) == "" and gpu_figures.as_text("x") == "x"


def test_a_staged_book_reaches_every_bench_step():
    plan = gpu_figures.steps("m", 64, prompt_file="models/.stage/b/book.txt")
    benches = [argv for _, argv in plan if argv[0] == "bench.bench"]
    assert len(benches) == 15 and all("--prompt-file" in a and "models/.stage/b/book.txt" in a for a in benches)
    assert not any("--prompt-file" in argv for _, argv in gpu_figures.steps("m", 64))


def test_a_failed_step_keeps_its_error_and_folds_repeated_warnings():
    """The first H200 run of bench.big_target died of a CUDA assert whose message was lost: the JSON
    kept only the last 8,000 characters, all teardown warnings differing by their timestamps."""
    from bench.gpu_figures import kept_output

    warning = "[W1127 07:24:33.{:09d} CUDAEvent.h:57] Warning: CUDA warning: device-side assert triggered"
    text = "\n".join(["[big_target] autoregressive: 310.2 ms/token", "error: CUDA error: device-side assert triggered",
                      *(warning.format(i) for i in range(3000)), "frame #40: _start + 0x25"])
    kept = kept_output(text, failed=True)
    assert "error: CUDA error" in kept and "[big_target] autoregressive" in kept and "frame #40" in kept
    assert "2999 more times" in kept and len(kept) < 1000
    long = "\n".join(f"line {i}" for i in range(5000))
    kept = kept_output(long, failed=True)
    assert kept.startswith("line 0\n") and kept.endswith("line 4999") and "[...]" in kept
    assert kept_output(long, failed=False) == long[-2000:]


def test_the_rehearsal_model_is_the_checkpoint_cut_to_its_first_layers(tmp_path):
    """The rehearsal's model loads the first REHEARSAL_LAYERS layers of the same weights (linked, not
    copied), dense even where the folder was prepared from a GGUF."""
    from tests.conftest import save_tiny, save_tokenizer
    from triforce.model.loader import load_model

    folder = tmp_path / "six"
    save_tiny(folder, seed=3, vocab=64, layers=6)
    save_tokenizer(folder, vocab=64)
    (folder / gpu_figures.MARKER).write_text(json.dumps({"source_gguf": "/nowhere.gguf"}))
    cut = gpu_figures.rehearsal_model(folder, tmp_path / "scratch")
    assert json.loads((cut / "config.json").read_text())["num_hidden_layers"] == gpu_figures.REHEARSAL_LAYERS
    assert not (cut / gpu_figures.MARKER).exists() and (cut / "model.safetensors").is_symlink()
    full, part = load_model(folder), load_model(cut)
    assert len(part.layers) == gpu_figures.REHEARSAL_LAYERS < len(full.layers)
    whole = full.state_dict()
    for name, value in part.state_dict().items():
        assert torch.equal(value, whole[name]), name
    # no model prepared: the steps that read it say so themselves, the others rehearse
    assert gpu_figures.rehearsal_model(tmp_path / "missing", tmp_path / "scratch2") == tmp_path / "missing"
