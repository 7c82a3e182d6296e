"""CURVE key pairs for the pipeline's TCP links (ZeroMQ's CurveZMQ: authentication and
encryption): ``NAME.key`` holds the public key (share it), ``NAME.key_secret`` both keys
(mode 0600, never leaves its host)."""

from __future__ import annotations

import os
from pathlib import Path

import zmq.auth


class CurveKeyError(ValueError):
    """A key file that cannot be used: missing, unreadable, or readable by others."""


def make_keys(folder: Path, names: list[str]) -> list[Path]:
    """A key pair per name in ``folder``; an existing pair is never overwritten."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    made = []
    for name in names:
        if (folder / f"{name}.key_secret").exists():
            raise CurveKeyError(f"{folder / name}.key_secret exists; remove it to make a new pair")
        old = os.umask(0o077)
        try:
            public, secret = zmq.auth.create_certificates(str(folder), name)
        finally:
            os.umask(old)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        made += [Path(public), Path(secret)]
    return made


def load_secret(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file that only its owner may read."""
    try:
        mode = path.stat().st_mode
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as error:
        raise CurveKeyError(f"cannot read the key {path}: {error}") from None
    if secret is None:
        raise CurveKeyError(f"{path} holds no secret key (a .key_secret file is needed)")
    if mode & 0o077:
        raise CurveKeyError(f"{path} may be read by others (mode {mode & 0o777:04o}); chmod 600 it")
    return public, secret


def load_public(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as error:
        raise CurveKeyError(f"cannot read the public key {path}: {error}") from None
    return public


class KnownKeys:
    """A ZeroMQ authenticator's credentials provider admitting exactly these public keys."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys
