"""The benches' prompts: the first tokens of a book's story, so that what follows continues it.

A book file ends with its end: Moby Dick's Project Gutenberg licence, Persuasion's "Finis". Until
session 54 the benches took a file's last N tokens, so every figure measured what a model writes
after a document has ended: it starts another (greedy SmolLM2 after Moby Dick's licence wrote
"<|endoftext|>" and then `# -*- coding`), and how well a retrieval cache or a drafter agrees with the
full cache there says little about continuing a long text. TriForce's PG-19 prompts are books'
beginnings; ours are too: the story (Gutenberg's header and licence cut, Windows line ends made
plain) from its first token, `context` tokens long.
"""
from __future__ import annotations

from triforce.model.errors import UserError
from triforce.runtime.text import gutenberg_story

CUT_MARGIN = 16  # tokens past those kept before the prefix's cut, or the whole story is encoded


def story_text(text: str) -> str:
    """A book's story: the text between Project Gutenberg's start and end markers where it has them
    (else all of it, stripped), with "\\r\\n" line ends made "\\n"."""
    return gutenberg_story(text.replace("\r\n", "\n"))[0].strip()


def story_prompt(tokenizer, text: str, tokens: int | None) -> list[int]:
    """The first `tokens` token ids of the story of `text` (None, or more than it has: all of them;
    the benches skip a context longer than that), encoded as a continuation (no special tokens)."""
    # a prefix of the text is enough, and encoding a whole 1.2 MB book takes seconds: English prose runs
    # about 4 characters a token, so 8 a token is plenty; the whole is encoded when it was not, or when
    # the tokens kept come near the cut (a word cut there encodes otherwise)
    story = story_text(text)
    if not story:
        raise UserError("the prompt file holds no text; name a book (or any text) with --prompt-file")
    prefix = story if tokens is None else story[:8 * tokens + 64]
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    if tokens is not None and len(ids) < tokens + CUT_MARGIN and len(prefix) < len(story):
        ids = tokenizer.encode(story, add_special_tokens=False)
    return ids[:tokens]


def open_story_session(run, text: str, tokens: int | None = None, **session_args):
    """cli.common.open_session over the first `tokens` (default run.context) tokens of the story of
    `text`, in place of the last run.context tokens of the whole file."""
    from triforce.cli.common import open_session
    from triforce.model.loader import load_tokenizer

    tokenizer = load_tokenizer(run.model)
    return open_session(run, story_prompt(tokenizer, text, tokens or run.context), tokenizer=tokenizer, **session_args)
