"""Work a ledger transaction did before and need not do again: never a check, only its repeat.

Every transaction reads, validates and (when it changed something) encodes the whole ledger under
the lock, and with a hundred entries that was most of the time the lock was held. Between two
transactions of one process most entries are the same as the last time it saw them: validating
an entry is a pure function of its content, and so is encoding one. So each process remembers,
for the entries of the last file it read, the validated entry, and for the entries it last
wrote, their JSON text, each by the entry's exact content.

That content is `marshal.dumps(value, 2)`: bytes that tell apart what `==` does not (True, 1 and
1.0 are equal in Python, though not to the validation: a `pid` of 1.0 is refused), and that
depend on the value alone (version 2 writes no back-references, whose use would depend on which
objects happen to be shared). Equal keys mean equal values of equal types, so a cached answer is
exactly the one the work would give: an entry whose content changed in any way, even to an
equal number of another type, is validated afresh. The whole file is still parsed every time,
and every check across entries (duplicate ids, caps) and every check of the entry's process
(alive, owner) still runs on every entry.

Each cache keeps only what the last read (or write) met, so it holds one file's worth at most.
"""

from __future__ import annotations

import json
import marshal
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

_T = TypeVar("_T")


def content_key(value: Any) -> bytes | None:
    """The exact content of a JSON value (dict, list, str, int, float, bool, None) as bytes;
    None when it cannot be told (nested beyond marshal's depth): such a value is not cached."""
    try:
        return marshal.dumps(value, 2)
    except ValueError:
        return None


class ValidatedEntries(Generic[_T]):
    """Validated entries of the last file read, by content.

    `validate` raises ValueError for an invalid entry; `copy` makes a copy whose containers are
    its own (callers change the entries they are given, which must not change the cache).
    """

    def __init__(self, validate: Callable[[Any], _T], copy: Callable[[_T], _T]) -> None:
        self._validate = validate
        self._copy = copy
        self._known: dict[bytes, _T] = {}

    def validate_all(self, raws: Sequence[Any]) -> tuple[list[_T], list[str]]:
        """The valid entries, each validated (or known, by its content, to be valid and to
        give this result), and what is wrong with each of the others."""
        known = self._known
        seen: dict[bytes, _T] = {}
        valid: list[_T] = []
        errors: list[str] = []
        for raw in raws:
            key = content_key(raw)
            entry = known.get(key) if key is not None else None
            if entry is None:
                try:
                    entry = self._validate(raw)
                except ValueError as exc:
                    errors.append(str(exc))
                    continue
            if key is not None:
                seen[key] = entry
            valid.append(self._copy(entry))
        self._known = seen
        return valid, errors

    def forget(self) -> None:
        self._known = {}


#: json.dumps(value, separators=(",", ":"), sort_keys=True), without making an encoder per call.
_dumps = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


class EncodedEntries:
    """JSON text of the entries last written, by content."""

    def __init__(self) -> None:
        self._known: dict[bytes, str] = {}
        self._wrote = False

    def encode(self, document: dict[str, Any], entries: str = "jobs") -> bytes:
        """Exactly `json.dumps(document, separators=(",", ":"), sort_keys=True).encode()`, with
        the text of each entry of the list `document[entries]` reused where an entry of the
        same content was encoded last time."""
        if not self._wrote:
            # A process's first write (often its only one: a submission) encodes in one go;
            # entry by entry, and telling each one's content, costs more the first time.
            self._wrote = True
            return _dumps(document).encode()
        known = self._known
        seen: dict[bytes, str] = {}
        parts = []
        for name, value in sorted(document.items()):
            if name == entries and type(value) is list:
                texts = []
                for entry in value:
                    key = content_key(entry)
                    text = known.get(key) if key is not None else None
                    if text is None:
                        text = _dumps(entry)
                    if key is not None:
                        seen[key] = text
                    texts.append(text)
                text = "[" + ",".join(texts) + "]"
            else:
                text = _dumps(value)
            parts.append(_dumps(name) + ":" + text)
        self._known = seen
        return ("{" + ",".join(parts) + "}").encode()

    def forget(self) -> None:
        self._known = {}
        self._wrote = False
