"""Bad input to generate.py: a non-zero exit, one line on stderr naming the problem, no traceback."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import save_tiny, save_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = " ".join(f"t{i % 60 + 3}" for i in range(200))


def run(*args, timeout=120):
    cmd = [sys.executable, str(ROOT / "scripts" / "generate.py"), "--threads", "1", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc, *words):
    assert proc.returncode != 0, proc.stdout
    err = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    last = err[-1]
    assert last.startswith("error:"), proc.stderr
    for w in words:
        assert w.lower() in last.lower(), last


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("other-vocab")
    save_tiny(folder, seed=2, vocab=80)
    save_tokenizer(folder, vocab=80)
    return folder


CASES = {
    "budget zero": (["--budget", "0"], ["budget"]),
    "budget not chunk multiple": (["--budget", "100", "--chunk-size", "8"], ["multiple of the chunk"]),
    "budget beyond prompt": (["--budget", "512"], ["smaller than the prompt"]),
    "gamma zero": (["--gamma2", "0"], ["gamma2"]),
    "negative temperature": (["--temperature", "-1"], ["temperature"]),
    "top-p out of range": (["--top-p", "1.5"], ["top-p"]),
    "context too long": (["--context", "100000", "--rope-scaling", "none"], ["exceeds"]),
    "prompt longer than the model": (["--rope-scaling", "none", "--max-new-tokens", "5000"], ["exceed"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_settings(tiny_folder, case):
    extra, words = CASES[case]
    proc = run("--model", tiny_folder, "--draft", "self", "--prompt", PROMPT, "--max-new-tokens", "4", *extra)
    assert_one_line_error(proc, *words)


def test_missing_model_folder(tmp_path):
    assert_one_line_error(run("--model", tmp_path / "nope", "--prompt", "t3"), "does not exist")


def test_mismatched_tokenizers(tiny_folder, other_vocab):
    proc = run("--model", tiny_folder, "--draft", other_vocab, "--prompt", PROMPT, "--mode", "speculative",
               "--max-new-tokens", "4")
    assert_one_line_error(proc, "different tokenizer")


def test_small_run_json(tiny_folder):
    """The same tiny model runs cleanly: exactly one JSON object on stdout, greedy-identical modes."""
    outs = {}
    for mode in ("autoregressive", "triforce"):
        proc = run("--model", tiny_folder, "--draft", "self", "--prompt", PROMPT, "--max-new-tokens", "12",
                   "--mode", mode, "--budget", "64", "--json")
        assert proc.returncode == 0, proc.stderr
        outs[mode] = json.loads(proc.stdout)
    assert outs["triforce"]["tokens"] == outs["autoregressive"]["tokens"]
    assert outs["triforce"]["acceptance"]["middle"] is not None
    assert outs["autoregressive"]["acceptance"] == {"draft": None, "middle": None}
