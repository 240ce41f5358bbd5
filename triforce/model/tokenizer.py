"""A checkpoint's tokenizer without importing transformers where a run only encodes and decodes.

transformers' import takes about a second of every start (1.0 s of 3.1 on the 2-core Xeon, after torch's
2.0), and a generate run asks its tokenizer for two things: a prompt's ids without special tokens and
the text of the ids it made. Both are the `tokenizers` library's own calls underneath transformers'
TokenizersBackend, so for a folder that backend would load as tokenizer.json stands (the folders
`triforce prepare` writes) this class makes those two calls on the `tokenizers` object itself and hands
everything else (a chat template, special tokens added by a post-processor, `tok(text)`, the vocabulary)
to transformers' tokenizer, loaded on first use. The same ids and text either way
(tests/model/test_tokenizer.py compares them on every path this class serves).
"""
from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from types import FunctionType

from .files import cache_home, write_whole

# tokenizer_config.json keys that change nothing in the two calls served here, given that every special
# token they name is already a special added token of tokenizer.json (checked). Any other key (a
# pre-tokenizer option such as add_prefix_space, split_special_tokens, code of its own) leaves the folder
# to transformers.
_NEUTRAL_KEYS = {"backend", "tokenizer_class", "model_max_length", "is_local", "local_files_only",
                 "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
                 "additional_special_tokens", "extra_special_tokens", "added_tokens_decoder",
                 "add_bos_token", "add_eos_token", "chat_template", "clean_up_tokenization_spaces",
                 "padding_side", "truncation_side", "model_input_names"}
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# what a tokenizer folder's behaviour can depend on: a remembered backend is keyed by their bytes
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
         "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


class Tokenizer:
    """encode(text, add_special_tokens=False[, split_special_tokens]) and decode(ids, ...,
    clean_up_tokenization_spaces=False) through `tokenizers`; every other use through transformers'
    tokenizer of the same folder (`full`), which the first such use loads. From then on `full` serves
    every call: a caller may change it (add special tokens, set a chat template), and its tokenizer is
    then the one that knows."""

    _OWN = ("backend", "folder", "_clean_up_spaces", "_full")

    def __init__(self, backend, folder: Path, clean_up_spaces: bool):
        for name, value in zip(self._OWN, (backend, folder, clean_up_spaces, None)):
            object.__setattr__(self, name, value)

    @property
    def full(self):
        """transformers' tokenizer of this folder (imports transformers the first time)."""
        if self._full is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import TokenizersBackend

            object.__setattr__(self, "_full", TokenizersBackend.from_pretrained(str(self.folder)))
        return self._full

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False, **kwargs) -> list[int]:
        if add_special_tokens or kwargs or self._full is not None:  # a post-processor's tokens, truncation, tensors
            return self.full.encode(text, add_special_tokens=add_special_tokens,
                                    split_special_tokens=split_special_tokens, **kwargs)
        # special-token strings in the text as plain text (True) or as their ids (False), as transformers
        # sets the same flag before each call
        self.backend.encode_special_tokens = split_special_tokens
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None,
               **kwargs) -> str:
        clean = self._clean_up_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean or kwargs or self._full is not None:  # transformers' clean-up rules (it skips them for BPE)
            return self.full.decode(ids, skip_special_tokens=skip_special_tokens,
                                    clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        ids = ids.tolist() if hasattr(ids, "tolist") else ids  # a tensor or an array of ids
        return self.backend.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)

    def __call__(self, *args, **kwargs):
        return self.full(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.full)

    def __bool__(self) -> bool:  # `tokenizer or load(...)` must not load transformers to ask len()
        return True

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not found above: no lazy load for private names (copy, pickle)
            raise AttributeError(name)
        return getattr(self.full, name)

    def __setattr__(self, name: str, value) -> None:  # tok.chat_template = ...: transformers' tokenizer's
        setattr(self.full, name, value)


def load_light(folder: str | Path) -> Tokenizer | None:
    """The folder's tokenizer as a `Tokenizer`, or None when transformers' TokenizersBackend would build
    something other than tokenizer.json as it stands (then the caller loads transformers' tokenizer)."""
    folder = Path(folder)
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text())
        if not (isinstance(declared, dict) and declared.get("tokenizer_class") == "TokenizersBackend"
                and set(declared) <= _NEUTRAL_KEYS):
            return None  # before reading tokenizer.json: Qwen's is 7 MB
        text = (folder / "tokenizer.json").read_text()
        spec = json.loads(text)
    except (OSError, ValueError):
        return None
    if not _specials_in_place(declared, spec):
        return None
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_str(text)
    except Exception:  # the library's own parse error: transformers reports it in the caller's words
        return None
    backend.no_truncation()
    backend.no_padding()
    return Tokenizer(backend, folder, bool(declared.get("clean_up_tokenization_spaces", False)))


def _specials_in_place(declared: dict, spec: dict) -> bool:
    """Every special token tokenizer_config.json names is a special added token of tokenizer.json with the
    same id, so transformers would add nor flag none (which would change splitting and skipping)."""
    added = {t.get("content"): t for t in spec.get("added_tokens") or []}
    named = [declared.get(key) for key in _SPECIAL_KEYS]
    named += list(declared.get("additional_special_tokens") or [])
    extra = declared.get("extra_special_tokens") or {}
    named += list(extra.values() if isinstance(extra, dict) else extra)
    for token in named:
        content = token.get("content") if isinstance(token, dict) else token
        if content is None:
            continue
        if not isinstance(content, str) or not added.get(content, {}).get("special"):
            return False
    for key, token in (declared.get("added_tokens_decoder") or {}).items():
        entry = added.get(token.get("content")) if isinstance(token, dict) else None
        if entry is None or str(entry.get("id")) != str(key) or bool(entry.get("special")) != bool(token.get("special")):
            return False
    return True


# ------------------------------------------------------------------------ backends transformers built
# A folder whose tokenizer class builds its pipeline in Python (Qwen2Tokenizer, from vocab and merges)
# costs transformers' import and that build on every start: 4.2 s for Qwen2.5-Coder on the 2-core Xeon,
# where the `tokenizers` object it ends with reads back from its own serialization in 0.7 s. So once
# transformers has built one, its backend is kept (`remember`) under the user's cache, keyed by the
# bytes of the folder's tokenizer files and the versions of the libraries, and later starts serve the
# two calls from it (`load_remembered`) as they do from tokenizer.json above. Only for classes that add
# nothing to TokenizersBackend but their constructor: then transformers' own encode and decode are
# TokenizersBackend's over that backend, which the `Tokenizer` class makes.

def files_stamp(folder: str | Path) -> tuple:
    """The folder and its tokenizer files' names, sizes, times and inodes: a version of the files, known
    without reading them, to remember what a process computed from them."""
    folder = Path(folder)
    stamp = []
    for name in FILES:
        try:
            st = (folder / name).stat()
        except OSError:
            continue
        stamp.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return str(folder.resolve()), tuple(stamp)


def files_digest(folder: str | Path) -> str:
    """sha256 over the folder's tokenizer files (names and bytes) and the versions of the libraries that
    read them: ~25 ms for Qwen's 11 MB, remembered per version of the files within a process."""
    folder = Path(folder)
    key = files_stamp(folder)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        for name, *_ in key[1]:
            data = (folder / name).read_bytes()
            h.update(f"{name}:{len(data)}:".encode())
            h.update(data)
        for library in ("tokenizers", "transformers", "jinja2"):
            try:
                h.update(f"{library}={metadata.version(library)};".encode())
            except metadata.PackageNotFoundError:
                h.update(f"{library}=none;".encode())
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict = {}
_BACKENDS: dict = {}  # files_stamp -> (backend, clean_up_spaces) of a Tokenizer this process loaded


def load_served(folder: str | Path) -> Tokenizer | None:
    """load_light(folder) or load_remembered(folder), the backend parsed once per version of the files
    in a process: the Python API's later runs of a model skip its parse (0.18 s of each of SmolLM2's:
    tokenizer.json read as JSON to check its special tokens, then by `tokenizers`). Each call gets a
    Tokenizer of its own (what a caller changes in its transformers tokenizer stays there); they share
    the `tokenizers` object, which encode sets up before every call."""
    stamp = files_stamp(folder)
    if stamp in _BACKENDS:
        backend, clean = _BACKENDS[stamp]
        return Tokenizer(backend, Path(folder), clean)
    tokenizer = load_light(folder) or load_remembered(folder)
    if tokenizer is not None:
        _BACKENDS[stamp] = (tokenizer.backend, tokenizer._clean_up_spaces)
    return tokenizer


def remembered_path(folder: str | Path) -> Path:
    """Where a folder's built backend is kept: $TRIFORCE_CACHE/tokenizers, by default
    ~/.cache/triforce/tokenizers ($XDG_CACHE_HOME honoured)."""
    return cache_home() / "tokenizers" / f"{files_digest(folder)[:40]}.json"


def load_remembered(folder: str | Path) -> Tokenizer | None:
    """The folder's tokenizer from the backend transformers built for these very files, or None."""
    try:
        record = json.loads(remembered_path(folder).read_text())
        text, clean = record["backend"], record["clean_up_spaces"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_str(text)
    except Exception:  # a file cut short, or one an older `tokenizers` wrote
        return None
    backend.no_truncation()
    backend.no_padding()
    return Tokenizer(backend, Path(folder), bool(clean))


def remember(folder: str | Path, full) -> None:
    """Keep the backend of transformers' tokenizer `full`, just loaded from `folder`, for later starts,
    where its class is TokenizersBackend or adds only a constructor to it. Best effort."""
    from transformers import TokenizersBackend

    if not isinstance(full, TokenizersBackend) or full.split_special_tokens:
        return  # the Tokenizer class encodes with special-token strings as tokens unless asked
    for cls in type(full).__mro__[:type(full).__mro__.index(TokenizersBackend)]:
        if any(isinstance(v, (FunctionType, property, staticmethod, classmethod)) for name, v in vars(cls).items()
               if name != "__init__"):
            return  # a subclass of its own behaviour: transformers serves it
    record = {"backend": full.backend_tokenizer.to_str(), "clean_up_spaces": bool(full.clean_up_tokenization_spaces)}
    write_whole(remembered_path(folder), json.dumps(record, ensure_ascii=False).encode())
