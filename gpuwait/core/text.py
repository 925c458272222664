"""Text from other users' files, made safe to show on a terminal."""

from __future__ import annotations


def printable(text: str, limit: int = 200) -> str:
    """`text` safe to print on another user's terminal: control characters (escape sequences)
    shown as '?', and at most `limit` characters."""
    import unicodedata  # only `status` prints foreign text; a launch does not pay for it

    cleaned = "".join(
        "?" if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn") else c
        for c in text[: limit + 1]
    )
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 1] + "…"
