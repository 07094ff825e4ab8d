import json
from pathlib import Path

import pytest

from mcore_rl.testing import make_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """The tiny BPE tokenizer; chat template: <|role|>content<|end|> ... <|assistant|>."""
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def plain_tokenizer(tmp_path_factory):
    """The same tokenizer without a chat template (a base model's)."""
    tok = make_tiny_tokenizer(tmp_path_factory.mktemp("tok_plain"))
    tok.chat_template = None
    return tok


@pytest.fixture
def write_lines():
    """write_lines(path, lines): a jsonl file where dicts are dumped as JSON and strings written as they are."""

    def write(path: Path, lines: list) -> Path:
        text = "".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines)
        path.write_text(text, encoding="utf-8")
        return path

    return write
