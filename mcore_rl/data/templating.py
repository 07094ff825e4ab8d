"""Prompt checking and rendering: a raw prompt (string or chat messages) -> the text the policy sees -> token ids."""

from __future__ import annotations

import math
from typing import Any


class RowProblem(ValueError):
    """What is wrong with one row, without its location (the caller adds file and row)."""


def check_prompt(row: dict[str, Any], key: str, apply_chat_template: bool) -> str | list[dict[str, str]]:
    """Return the row's prompt if it is a non-empty string or a well-formed message list, else raise RowProblem."""
    value = _get(row, key)
    if isinstance(value, str):
        if not value.strip():
            raise RowProblem(f"{key!r} is empty")
        return value
    if isinstance(value, list):
        if not apply_chat_template:
            raise RowProblem(
                f"{key!r} is a list of chat messages, which needs a chat template; set apply_chat_template=true"
            )
        return _check_messages(value, key)
    raise RowProblem(f"{key!r} must be a string or a list of chat messages, got {_type_name(value)}")


def check_text(row: dict[str, Any], key: str) -> str:
    """A non-empty string field (DPO responses)."""
    value = _get(row, key)
    if not isinstance(value, str):
        raise RowProblem(f"{key!r} must be a string, got {_type_name(value)}")
    if not value.strip():
        raise RowProblem(f"{key!r} is empty")
    return value


def check_answer(row: dict[str, Any], key: str) -> str:
    """A reference answer: a non-empty string or a finite number, returned as a string."""
    value = _get(row, key)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowProblem(f"{key!r} must be a string or a number, got {_type_name(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RowProblem(f"{key!r} is {value}")
    text = str(value)
    if not text.strip():
        raise RowProblem(f"{key!r} is empty")
    return text


def check_present(row: dict[str, Any], key: str) -> Any:
    if key not in row:
        raise RowProblem(f"missing key {key!r} (row has {sorted(row)})")
    return row[key]


def build_messages(prompt: str | list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(
    tokenizer: Any, prompt: str | list[dict[str, str]], system_prompt: str | None, apply_chat_template: bool,
    tools: list[dict] | None = None,
) -> tuple[str, list[dict[str, str]] | None]:
    """The text the policy is given, and the chat messages it came from (None without a chat template). tools:
    the chat template's `tools=` list (agent tasks), or None."""
    if not apply_chat_template:
        assert isinstance(prompt, str), "check_prompt refuses message lists without a chat template"
        return (prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}"), None
    messages = build_messages(prompt, system_prompt)
    try:
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as e:  # template code may raise on data it does not accept (e.g. roles out of order)
        raise RowProblem(f"the chat template refused the prompt: {type(e).__name__}: {e}") from None
    return text, messages


def require_chat_template(tokenizer: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"apply_chat_template is true but the tokenizer ({type(tokenizer).__name__}, "
            f"{getattr(tokenizer, 'name_or_path', '?')}) has no chat_template; set apply_chat_template=false "
            "for a base model, or use a tokenizer that defines one"
        )


def encode(tokenizer: Any, texts: list[str], add_special_tokens: bool, chunk: int = 1024) -> list[list[int]]:
    """Token ids of each text; in chunks so that a large dataset does not build one huge encoding at once."""
    ids: list[list[int]] = []
    for start in range(0, len(texts), chunk):
        ids.extend(tokenizer(texts[start : start + chunk], add_special_tokens=add_special_tokens)["input_ids"])
    return ids


def _check_messages(messages: list[Any], key: str) -> list[dict[str, str]]:
    if not messages:
        raise RowProblem(f"{key!r} is an empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowProblem(f"{key!r} message {i} must be an object with string 'role' and 'content', got {m!r:.80}")
    if not any(m["content"].strip() for m in messages):
        raise RowProblem(f"{key!r} messages are all empty")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _get(row: dict[str, Any], key: str) -> Any:
    value = check_present(row, key)
    if value is None:
        raise RowProblem(f"{key!r} is null")
    return value


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__
