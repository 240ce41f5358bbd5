"""Bad input to the front ends: a non-zero exit, a last stderr line "error: ..." naming the problem,
no traceback. One table of cases, each run as a fresh process of every front end it applies to
(generate.py reads the text with --prompt-file, chat.py with --book)."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

import subprocess
import sys

import pytest

from triforce.cli import chat, generate
from triforce.parallel import resolve_device
from triforce.cli.common import generation_config
from triforce.runtime.session import HOST_MEMORY_ENV, host_available_bytes
from triforce.runtime.settings import check_flags, make_settings
from triforce.cli.common import as_flags
from triforce.speculative import UserError

from ..helpers import assert_one_line_error, run
from ..conftest import save_tiny, save_tokenizer

PROMPT = " ".join(f"t{i % 60 + 3}" for i in range(200))  # 273 tokens for generate.py, 237 + template for chat
TEXT_FLAG = {"generate": "--prompt-file", "chat": "--book"}


@dataclass(frozen=True)
class Case:
    words: tuple  # what the error line must say (case-insensitive)
    flags: tuple = ()
    model: str = "model"  # keys of the `inputs` fixture
    draft: str = "self"
    text: str = "prompt"
    env: dict = field(default_factory=dict)
    only: str | None = None  # the one front end the case means something to

    def fronts(self) -> list[str]:
        return [self.only] if self.only else list(TEXT_FLAG)


CASES = {
    # the model folder
    "missing model folder": Case(("model folder", "does not exist"), model="missing"),
    "folder without config.json": Case(("no config.json",), model="no-config"),
    "truncated safetensors": Case(("model.safetensors", "corrupt or truncated"), model="truncated"),
    "corrupt safetensors header": Case(("model.safetensors", "corrupt or truncated"), model="corrupt"),
    "unsupported architecture": Case(("unsupported architecture 'mamba'",), model="mamba"),
    "drafter with another tokenizer": Case(("different tokenizer",), ("--mode", "speculative"), draft="other-vocab"),
    # the text
    "text file missing": Case(("absent.txt", "does not exist"), text="absent"),
    "text file empty": Case(("empty.txt", "is empty"), text="empty"),
    "text file /dev/null": Case(("/dev/null", "is empty"), text="devnull"),
    "text file binary": Case(("binary.bin", "binary"), text="binary"),
    "text file not UTF-8": Case(("latin1.txt", "not utf-8"), text="latin1"),
    # positions
    "context beyond the model": Case(("--context 100000", "exceeds", "positions"),
                                     ("--context", "100000", "--rope-scaling", "none"), only="generate"),
    "prompt and new tokens beyond the model": Case(("exceed", "--rope-scaling"),
                                                   ("--rope-scaling", "none", "--max-new-tokens", "5000"), only="generate"),
    "book beyond the model": Case(("does not fit", "4,096-token context", "--context"),
                                  ("--rope-scaling", "none", "--room", "100"), text="long", only="chat"),
    # retrieval budget
    "budget zero": Case(("budget",), ("--budget", "0"), only="generate"),
    "budget beyond the prompt": Case(("budget 512", "smaller than the prompt"), ("--budget", "512")),
    "budget not a chunk multiple": Case(("budget 100", "multiple of the chunk size 32"), ("--budget", "100")),
    # speculation lengths and sampling
    "gamma1 zero": Case(("gamma1", ">= 1"), ("--gamma1", "0")),
    "gamma1 negative": Case(("gamma1", ">= 1"), ("--gamma1", "-2")),
    "gamma2 zero": Case(("gamma2", ">= 1"), ("--gamma2", "0")),
    "gamma2 negative": Case(("gamma2", ">= 1"), ("--gamma2", "-1")),
    "temperature negative": Case(("temperature", ">= 0"), ("--temperature", "-0.5")),
    "top-p zero": Case(("top-p", "(0, 1]"), ("--top-p", "0")),
    "top-p above one": Case(("top-p", "(0, 1]"), ("--top-p", "1.5")),
    # memory: refused before the weights are read, so the truncated checkpoint is never noticed
    "host memory too small": Case(("memory", "available", "--context"), model="truncated",
                                  env={HOST_MEMORY_ENV: "4096"}),
}
MATRIX = [(front, name) for name, case in CASES.items() for front in case.fronts()]


@pytest.fixture(scope="module")
def inputs(tiny_folder, tmp_path_factory):
    """Name -> path: the tiny model, damaged copies of it, a model with another vocabulary, texts."""
    base = tmp_path_factory.mktemp("bad-inputs")
    paths = {"model": tiny_folder, "missing": base / "nope"}
    for name in ("no-config", "truncated", "corrupt", "mamba"):
        paths[name] = shutil.copytree(tiny_folder, base / name)
    (paths["no-config"] / "config.json").unlink()
    weights = paths["truncated"] / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    weights = paths["corrupt"] / "model.safetensors"
    weights.write_bytes(b"\xde\xad\xbe\xef" * 16 + weights.read_bytes()[64:])  # the header length, then garbage
    config = json.loads((paths["mamba"] / "config.json").read_text())
    config.update(architectures=["MambaForCausalLM"], model_type="mamba")
    (paths["mamba"] / "config.json").write_text(json.dumps(config))
    paths["other-vocab"] = base / "other-vocab"
    save_tiny(paths["other-vocab"], seed=2, vocab=80)
    save_tokenizer(paths["other-vocab"], vocab=80)
    texts = {"prompt.txt": PROMPT.encode(), "long.txt": " ".join(f"t{3 + i % 60}" for i in range(4500)).encode(),
             "empty.txt": b"  \n", "binary.bin": b"t1\x00\x01", "latin1.txt": b"t5 \xff\xfe t6"}
    for filename, data in texts.items():
        (base / filename).write_bytes(data)
        paths[filename.split(".")[0]] = base / filename
    paths["absent"] = base / "absent.txt"
    paths["devnull"] = "/dev/null"  # it exists but is no regular file: said to be empty, not missing
    return paths


@pytest.mark.parametrize("front,case", MATRIX, ids=[f"{front}: {name}" for front, name in MATRIX])
def test_bad_input(inputs, front, case):
    c = CASES[case]
    draft = c.draft if c.draft == "self" else inputs[c.draft]
    proc = run(front, "--model", inputs[c.model], "--draft", draft, TEXT_FLAG[front], inputs[c.text],
               "--max-new-tokens", "4", *c.flags, env=c.env)
    assert_one_line_error(proc, *c.words)


# ------------------------------------------------------------------- checks that need no process
@pytest.mark.parametrize("flags,words", [
    (["--threads", "-1"], "--threads must be at least 1"),
    (["--offload-chunk", "0"], "--offload-chunk must be a positive"),
    (["--onchip-layers", "some"], "--onchip-layers must be 'auto' or a number"),
    (["--onchip-layers", "-2"], "--onchip-layers must be 'auto' or a number"),
])
def test_model_flags_refused_before_torch_uses_them(flags, words):
    """Refused while parsing, before torch is imported; the library names the setting, the command
    line the flag."""
    with pytest.raises(UserError) as refused:
        generate.parse_args(["--prompt", "t3", *flags])
    assert words in as_flags(str(refused.value))
    with pytest.raises(UserError):
        check_flags(make_settings(None, None, **dict(zip([f.lstrip("-").replace("-", "_") for f in flags[::2]],
                                                         [int(v) if v.lstrip("-").isdigit() else v for v in flags[1::2]]))))


@pytest.mark.parametrize("flag", ["--compile", "--cuda-graphs"])
def test_graph_flags_under_tensor_parallelism_are_refused(flag):
    """A rank's passes run eagerly around their all-reduce hooks (eager_steps.watched), so the flag could
    only be ignored: it is refused while parsing, naming it, rather than silently doing nothing."""
    with pytest.raises(UserError) as refused:
        generate.parse_args(["--prompt", "t3", "--tp", "2", flag])
    assert as_flags(str(refused.value)).startswith(f"{flag} does not apply under tensor parallelism (--tp 2)")
    generate.parse_args(["--prompt", "t3", "--tp", "1", flag])  # one process: taken


def test_a_worker_that_lost_its_peers_is_silent_after_their_error(tmp_path, monkeypatch, capsys):
    """Between the workers of one triforce-tp launch (SAID_ENV): a line is said once, and a peer's
    loss (PeerStopped, mostly what another worker's own error left behind) only where no line was."""
    from triforce.cli.common import SAID_ENV, say_error

    monkeypatch.setenv(SAID_ENV, str(tmp_path / "first"))
    (tmp_path / "first").mkdir()
    say_error("error: tensor-parallel worker 0 stopped responding", consequence=True)  # nothing said before
    say_error("error: tensor-parallel worker 0 stopped responding", consequence=True)
    monkeypatch.setenv(SAID_ENV, str(tmp_path / "second"))
    (tmp_path / "second").mkdir()
    say_error("error: budget 64 is too small")
    say_error("error: budget 64 is too small")  # the other rank met it too
    say_error("error: tensor-parallel worker 1 could not join the group of 2", consequence=True)
    assert capsys.readouterr().err.splitlines() == ["error: tensor-parallel worker 0 stopped responding",
                                                    "error: budget 64 is too small"]


def test_flag_checks_import_no_torch():
    """`triforce generate --max-new-tokens -5` is refused in well under a second: before torch loads."""
    code = ("import sys; from triforce.cli import generate\n"
            "try:\n    generate.parse_args(['--max-new-tokens', '-5'])\nexcept Exception as e:\n    print(e)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.split("\n")
    assert out[:2] == ["Settings.max_new_tokens must be >= 1 (got -5)", "False"], out


def test_unknown_device_is_named():
    with pytest.raises(UserError) as refused:
        resolve_device("tpu")
    assert as_flags(str(refused.value)).startswith("--device tpu not understood: use cpu, cuda")


def test_chunk_size_zero_is_named_not_a_division_by_zero():
    with pytest.raises(UserError, match="chunk size must be > 0"):
        generation_config(generate.parse_args(["--prompt", "t3", "--chunk-size", "0"]).run, prompt_len=300)


def test_memory_override(monkeypatch):
    monkeypatch.setenv(HOST_MEMORY_ENV, "12345")
    assert host_available_bytes() == 12345
    monkeypatch.setenv(HOST_MEMORY_ENV, "lots")
    with pytest.raises(UserError, match=HOST_MEMORY_ENV):
        host_available_bytes()


@pytest.mark.parametrize("flags,words", [(["--room", "0"], "--room must be"), (["--context", "0"], "--context must")])
def test_chat_sizes(flags, words):
    with pytest.raises(UserError, match=words):
        chat.parse_args(["--book", "b.txt", *flags])


# ------------------------------------------------------------------- and good input runs
def test_small_run_json(tiny_folder):
    """The same tiny model runs cleanly: exactly one JSON object on stdout, greedy-identical modes."""
    outs = {}
    for mode in ("autoregressive", "triforce"):
        proc = run("generate", "--model", tiny_folder, "--draft", "self", "--prompt", PROMPT, "--max-new-tokens", "12",
                   "--mode", mode, "--budget", "64", "--chunk-size", "8", "--json")
        assert proc.returncode == 0, proc.stderr
        outs[mode] = json.loads(proc.stdout)
    assert outs["triforce"]["tokens"] == outs["autoregressive"]["tokens"]
    assert outs["triforce"]["acceptance"]["middle"] is not None
    assert outs["autoregressive"]["acceptance"] == {"draft": None, "lookup": None, "middle": None}
    # drafts looked up in the text: no drafter model, the same tokens
    proc = run("generate", "--model", tiny_folder, "--draft", "lookup", "--prompt", PROMPT, "--max-new-tokens", "12",
               "--mode", "triforce", "--budget", "64", "--chunk-size", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    lookup = json.loads(proc.stdout)
    assert lookup["tokens"] == outs["autoregressive"]["tokens"] and lookup["draft"] == "lookup"
    assert lookup["acceptance"]["draft"] is not None
