"""How an error is shown in one line (a log line, a reason passed on)."""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of an error's message with its whitespace collapsed, or its repr when it has none."""
    text = str(e).strip()
    return " ".join(text.splitlines()[0].split()) if text else repr(e)
