"""A run's tokenizer without transformers (model/tokenizer.py): the same ids and text as transformers'
tokenizer of the folder on every call it serves itself, transformers' tokenizer for the rest, and a
fresh interpreter that encodes and decodes never imports transformers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from triforce.model.loader import load_tokenizer
from triforce.model.tokenizer import Tokenizer, load_light

from ..conftest import save_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "smollm2-135m"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# special-token strings inside text, several scripts, an emoji split across byte tokens, odd spacing
TEXTS = ["It is a truth universally acknowledged, that a single man",
         "<|im_start|>user\nWho is Anne?<|im_end|>\n<|im_start|>assistant\n",
         "naïve café — Zürich 東京 🙂🙂 done", "  leading and  double  spaces\n\n\ttab <|endoftext|>", ""]


def save_byte_level(folder: Path) -> None:
    """A small byte-level BPE (SmolLM2's and Qwen's kind) with special tokens and a chat template, saved
    the way `triforce prepare` saves a converted GGUF's tokenizer."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
    from transformers import TokenizersBackend

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([(ROOT / "triforce" / "data" / "persuasion.txt").read_text()[:20_000]], trainer)
    tok = TokenizersBackend(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            unk_token="<|endoftext|>", pad_token="<|im_end|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("tokenizers")
    save_tokenizer(base / "word-level", vocab=64)
    save_byte_level(base / "byte-level")
    made = {"word-level": base / "word-level", "byte-level": base / "byte-level"}
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


@pytest.mark.parametrize("name", ["word-level", "byte-level", "smollm2-135m"])
def test_the_same_ids_and_text_as_transformers(folders, name):
    if name not in folders:
        pytest.skip("models/smollm2-135m missing: run triforce-prepare")
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
    stands (a pre-tokenizer option; a special token tokenizer.json does not flag) gets transformers'."""
    import shutil

    for change in ({"add_prefix_space": True}, {"eos_token": "t9"}, {"tokenizer_class": "PreTrainedTokenizerFast"}):
        folder = tmp_path / "changed"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(folders["word-level"], folder)
        config = folder / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
        assert load_light(folder) is None, change
        assert not isinstance(load_tokenizer(folder), Tokenizer)
    assert load_light(tmp_path / "nowhere") is None


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
