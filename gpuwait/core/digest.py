"""SHA-256 hex digests of text, for command keys and simulated UUIDs.

The built-in implementation gives the same digests as `hashlib.sha256`, without hashlib loading
OpenSSL: some 2.5 ms of every launch.
"""

from __future__ import annotations

try:
    from _sha256 import sha256  # type: ignore[import-not-found]  # 3.10, 3.11; not in typeshed
except ImportError:  # pragma: no cover - depends on the Python version
    try:
        from _sha2 import sha256  # type: ignore[import-not-found, unused-ignore]  # 3.12+
    except ImportError:
        from hashlib import sha256  # a build without it


def sha256_hex(text: str) -> str:
    # surrogateescape: a command's argument or path that is no UTF-8 (a Latin-1 file name)
    # reaches Python as surrogates, and is hashed as the bytes it was.
    digest: str = sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
    return digest
