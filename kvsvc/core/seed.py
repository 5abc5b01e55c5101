"""The hash seed from outside the process: the seed file, and the fingerprint that names it.

A cluster's servers and its scorer must hash with the same seed (:class:`kvsvc.core.hashing.
BlockHasher`), so they read it the same way and compare fingerprints rather than seeds: for
``xxh3_128`` the seed is a secret. Reading the file is this module's only I/O; it lives
beside the hashing so that ``kvsvc serve``, a config file's ``hash_seed_file`` and the
cluster's commands all agree on what a seed file holds.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# What a fingerprint is computed over: a fixed prefix, so it is of no use as a hash of the
# seed anywhere else.
_FINGERPRINT_PREFIX = b"kvsvc-hash-seed\0"


def seed_fingerprint(seed: str) -> str:
    """Hex of the first 16 bytes of SHA-256(prefix + seed): lets a scorer check that it
    hashes with the servers' seed, while the seed (a secret for ``xxh3_128``) stays put."""
    return hashlib.sha256(_FINGERPRINT_PREFIX + seed.encode()).hexdigest()[:32]


def read_seed_file(path: str, what: str = "--hash-seed-file") -> str:
    """The seed in ``path``: its first line that is neither blank nor a ``#`` comment
    (surrounding whitespace dropped), like a token file.

    Raises:
        ValueError: the file cannot be read or holds no seed (the message names ``what``).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path}: not UTF-8 text") from None
    for line in text.splitlines():
        seed = line.strip()
        if seed and not seed.startswith("#"):
            return seed
    raise ValueError(f"{what} {path} holds no seed (one line of text; blank and # lines skip)")
