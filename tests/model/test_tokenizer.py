"""A run's tokenizer without transformers (model/tokenizer.py): the same ids and text as transformers'
tokenizer of the folder on every call it serves itself, transformers' tokenizer for the rest, and a
fresh interpreter that encodes and decodes never imports transformers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from triforce.model.loader import load_tokenizer
from triforce.model import tokenizer as tokenizer_module
from triforce.model.tokenizer import Tokenizer, load_light

from ..conftest import save_byte_level, save_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "smollm2-135m"
# special-token strings inside text, several scripts, an emoji split across byte tokens, odd spacing
TEXTS = ["It is a truth universally acknowledged, that a single man",
         "<|im_start|>user\nWho is Anne?<|im_end|>\n<|im_start|>assistant\n",
         "naïve café — Zürich 東京 🙂🙂 done", "  leading and  double  spaces\n\n\ttab <|endoftext|>", ""]


@pytest.fixture(scope="module", autouse=True)
def own_cache(tmp_path_factory):
    """Backends transformers built are kept under $TRIFORCE_CACHE (and this module's children see it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRIFORCE_CACHE", str(tmp_path_factory.mktemp("kept")))
        yield


def save_qwen2_class(folder: Path, source: Path) -> None:
    """The byte-level BPE as Qwen2Tokenizer, a class that builds its pipeline in Python from vocab and
    merges (tokenizer_config.json names it, as Qwen2.5's folders do)."""
    from transformers import Qwen2Tokenizer

    model = json.loads((source / "tokenizer.json").read_text())["model"]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]], eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                         additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("tokenizers")
    save_tokenizer(base / "word-level", vocab=64)
    save_byte_level(base / "byte-level")
    save_qwen2_class(base / "qwen2-class", base / "byte-level")
    made = {"word-level": base / "word-level", "byte-level": base / "byte-level", "qwen2-class": base / "qwen2-class"}
    if SMOLLM2.is_dir():
        made["smollm2-135m"] = SMOLLM2
    return made


def transformers_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def texts_for(name: str) -> list[str]:
    if name == "word-level":
        return ["t0 t5 t63 t1 t7 unknown", "t3 t1 t1 t2", ""]
    return TEXTS + ([(ROOT / "triforce" / "data" / "persuasion.txt").read_text()] if name == "smollm2-135m" else [])


@pytest.mark.parametrize("name", ["word-level", "byte-level", "smollm2-135m", "qwen2-class"])
def test_the_same_ids_and_text_as_transformers(folders, name):
    """tokenizer.json as it stands, or (qwen2-class) the backend transformers built at the first load."""
    if name not in folders:
        pytest.skip("models/smollm2-135m missing: run triforce-prepare")
    if name == "qwen2-class":
        first = load_tokenizer(folders[name])
        assert not isinstance(first, Tokenizer) and load_light(folders[name]) is None
    tok, want = load_tokenizer(folders[name]), transformers_tokenizer(folders[name])
    assert isinstance(tok, Tokenizer) and tok._full is None
    for text in texts_for(name):
        for split in (False, True):
            ids = tok.encode(text, add_special_tokens=False, split_special_tokens=split)
            assert ids == want.encode(text, add_special_tokens=False, split_special_tokens=split)
        ids = want.encode(text, add_special_tokens=False)
        for skip in (False, True):
            for end in range(len(ids) + 1) if len(ids) < 200 else (len(ids) // 3, len(ids)):
                # every prefix, as the streaming detokenizer decodes them: a cut character gives U+FFFD alike
                got = tok.decode(ids[:end], skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                assert got == want.decode(ids[:end], skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert tok._full is None  # all of it without transformers' tokenizer


def test_everything_else_is_transformers_tokenizer(folders):
    """The calls it does not serve itself give transformers' answers, and once transformers' tokenizer
    is loaded (and perhaps changed) it serves every call."""
    tok, want = load_tokenizer(folders["byte-level"]), transformers_tokenizer(folders["byte-level"])
    text = TEXTS[1]
    assert bool(tok) and tok._full is None  # `tok or load(...)` asks nothing of transformers
    assert tok(text)["input_ids"] == want(text)["input_ids"]
    assert tok.encode(text) == want.encode(text) and tok.get_vocab() == want.get_vocab()
    assert tok.eos_token_id == want.eos_token_id and tok.all_special_ids == want.all_special_ids
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        want.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})  # a change only transformers' knows
    tok.chat_template = "{{ messages[0]['content'] }}"
    assert tok.full.chat_template == "{{ messages[0]['content'] }}"
    tool = tok.full.convert_tokens_to_ids("<|tool|>")
    assert tok.encode("a <|tool|>", add_special_tokens=False)[-1] == tool
    assert tok.decode([5, tool], skip_special_tokens=True, clean_up_tokenization_spaces=False) == \
        tok.full.decode([5], skip_special_tokens=True)


def test_folders_transformers_would_change_load_transformers_tokenizer(folders, tmp_path):
    """A tokenizer_config.json that makes transformers build something other than tokenizer.json as it
    stands (a pre-tokenizer option; a special token tokenizer.json does not flag) gets transformers' on
    the first load, and the backend transformers built on the next: the same ids and text."""
    import shutil

    for change in ({"add_prefix_space": True}, {"eos_token": "t9"}, {"tokenizer_class": "PreTrainedTokenizerFast"}):
        folder = tmp_path / "changed"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(folders["word-level"], folder)
        config = folder / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
        assert load_light(folder) is None, change
        want = load_tokenizer(folder)
        assert not isinstance(want, Tokenizer)
        tok = load_tokenizer(folder)
        assert isinstance(tok, Tokenizer), change
        for text in ("t0 t5 t9 t63 t1 unknown", " t9t9 t1", ""):
            for split in (False, True):
                ids = tok.encode(text, add_special_tokens=False, split_special_tokens=split)
                assert ids == want.encode(text, add_special_tokens=False, split_special_tokens=split), (change, text)
                for skip in (False, True):
                    assert tok.decode(ids, skip_special_tokens=skip) == want.decode(ids, skip_special_tokens=skip)
        assert tok._full is None
    assert load_light(tmp_path / "nowhere") is None


def test_a_kept_backend_serves_only_the_files_it_was_built_from(folders, tmp_path):
    """A changed tokenizer file, or a class that adds behaviour of its own, loads transformers' tokenizer."""
    import shutil

    from transformers import Qwen2Tokenizer

    from triforce.model.tokenizer import remember, remembered_path

    folder = tmp_path / "qwen2"
    shutil.copytree(folders["qwen2-class"], folder)
    load_tokenizer(folder)
    assert isinstance(load_tokenizer(folder), Tokenizer)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token": "<|endoftext|>"}))
    changed = load_tokenizer(folder)
    assert not isinstance(changed, Tokenizer) and changed.eos_token == "<|endoftext|>"
    assert isinstance(load_tokenizer(folder), Tokenizer)
    remembered_path(folder).write_text('{"backend": "not a tokenizer", "clean_up_spaces": false}')
    tokenizer_module._BACKENDS.clear()  # a later process's start: the file is read again
    assert not isinstance(load_tokenizer(folder), Tokenizer)  # a kept file that does not read back

    class OwnDecode(Qwen2Tokenizer):
        def _decode(self, *args, **kwargs):
            return "changed"

    other = tmp_path / "own"
    shutil.copytree(folders["qwen2-class"], other)
    (other / "tokenizer_config.json").write_text(config.read_text().replace("<|endoftext|>", "<|im_start|>", 1))
    remember(other, OwnDecode.from_pretrained(str(other)))
    assert not remembered_path(other).exists()


@pytest.mark.parametrize("name", ["byte-level", "qwen2-class"])
def test_a_process_parses_a_folders_tokenizer_once(folders, tmp_path, name):
    """Later loads of the same files in a process (the Python API's later runs) share the parsed
    backend but not the wrapper, so a caller's changes to its tokenizer stay its own; changed files
    are parsed again."""
    import shutil

    folder = tmp_path / name
    shutil.copytree(folders[name], folder)
    load_tokenizer(folder)  # qwen2-class: transformers builds it, and its backend is remembered
    first, second = load_tokenizer(folder), load_tokenizer(folder)
    assert isinstance(first, Tokenizer) and first is not second and first.backend is second.backend
    first.full.add_special_tokens({"additional_special_tokens": ["<|new|>"]})
    assert "<|new|>" not in second.full.get_vocab()
    assert second.encode(TEXTS[1], add_special_tokens=False) == transformers_tokenizer(folder).encode(
        TEXTS[1], add_special_tokens=False)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 1234}))
    changed = load_tokenizer(folder)
    assert getattr(changed, "backend", None) is not first.backend and changed.model_max_length == 1234


def test_a_run_encodes_and_decodes_without_importing_transformers(folders):
    code = ("import sys; from triforce.model.loader import load_tokenizer; from triforce.runtime.text import StreamingText\n"
            f"tok = load_tokenizer({str(folders['byte-level'])!r})\n"
            f"ids = tok.encode({TEXTS[2]!r}, add_special_tokens=False)\n"
            "stream = StreamingText(tok); text = ''.join(stream.push([i]) for i in ids) + stream.rest()\n"
            f"assert text == {TEXTS[2]!r}, text\n"
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
