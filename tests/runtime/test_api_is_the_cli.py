"""`triforce.generate(...)` and `triforce generate --json` are one engine: the same prompt and
settings give the same tokens and the same resolved settings (dtype, threads, budget, gammas, mode,
sampling), every default left to each of them."""
from __future__ import annotations

import json
import subprocess

import pytest

import triforce

from ..conftest import tiny_with_tokenizer
from ..helpers import command

PROMPT = " ".join(f"t{3 + (i * 7) % 60}" for i in range(300))
RESOLVED = ("dtype", "device", "threads", "threads_why", "temperature", "top_p", "budget", "chunk_size", "gamma1",
            "gamma2", "rope_scaling", "tp", "offload", "lower_weights")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_with_tokenizer(tmp_path_factory, "api-cli", seed=11)


@pytest.mark.parametrize("flags", [{}, {"mode": "retrieval", "max_new_tokens": 12}, {"mode": "autoregressive"}],
                         ids=["defaults", "retrieval", "autoregressive"])
def test_same_tokens_and_settings(model, monkeypatch, flags):
    # threads by the same rule on both sides, but not by the load of the moment: a launcher's share
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--model", model, "--prompt", PROMPT, "--json"]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    cmd = [c for c in command("generate", *argv) if c not in ("--threads", "1")]  # threads: the default rule
    cmd.remove("--device"), cmd.remove("cpu")  # the device too: auto on both sides
    cli = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    ours = json.loads(cli.stdout)

    api = triforce.generate(PROMPT, model=str(model), **flags)
    assert api.tokens == ours["tokens"]
    assert api.text == ours["text"]
    assert {k: api.settings[k] for k in RESOLVED} == {k: ours["settings"][k] for k in RESOLVED}
    assert (api.report["mode"], api.report["adaptive"]) == (ours["mode"], ours["adaptive"])
    assert ours["settings"]["threads_why"] == "OMP_NUM_THREADS"


def test_unknown_setting_names_the_real_ones(model):
    with pytest.raises(triforce.UserError, match="unknown setting budgt.*budget"):
        triforce.generate("t3 t4", model=str(model), budgt=64)


def test_errors_name_settings_in_python_and_flags_on_the_command_line(model):
    with pytest.raises(triforce.UserError, match=r"Settings\.max_new_tokens must be >= 1"):
        triforce.generate("t3 t4", model=str(model), max_new_tokens=0)
    proc = subprocess.run(command("generate", "--model", model, "--prompt", "t3 t4", "--max-new-tokens", "0"),
                          capture_output=True, text=True, timeout=120)
    assert proc.stderr.strip().splitlines()[-1] == "error: --max-new-tokens must be >= 1 (got 0)"


def test_a_gutenberg_prompt_file_is_read_between_its_markers(model, tmp_path, caplog):
    """A prompt file with Project Gutenberg's markers: both front ends continue its story, not its
    licence, and say what they left out; a prompt given as a string is taken as it is."""
    book = tmp_path / "book.txt"
    wrapped = ("The Project Gutenberg EBook of T\n\n*** START OF THIS PROJECT GUTENBERG EBOOK T ***\n\n" + PROMPT
               + "\n\n*** END OF THIS PROJECT GUTENBERG EBOOK T ***\n" + " t9" * 100)
    book.write_text(wrapped)
    note = (f"book.txt: read between Project Gutenberg's start and end markers (its header and licence, "
            f"{len(wrapped) - len(PROMPT):,} characters, left out)")
    flags = {"mode": "autoregressive", "max_new_tokens": 6}
    cli = subprocess.run(command("generate", "--model", model, "--prompt-file", str(book), "--json", "--mode",
                                 "autoregressive", "--max-new-tokens", "6"), capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert note in " ".join(cli.stderr.split())
    with caplog.at_level("INFO", logger="triforce"):
        from_file = triforce.generate(prompt_file=str(book), model=str(model), **flags)
    assert note in caplog.text
    story = triforce.generate(PROMPT, model=str(model), **flags)
    assert from_file.tokens == story.tokens == json.loads(cli.stdout)["tokens"]
    assert from_file.report["prompt_tokens"] == story.report["prompt_tokens"]
    as_given = triforce.generate(wrapped, model=str(model), **flags)
    assert as_given.report["prompt_tokens"] > story.report["prompt_tokens"]
