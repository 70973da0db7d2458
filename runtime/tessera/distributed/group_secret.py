"""The group's shared secret, and every key derived from it (docs/SECURITY.md, "Rank traffic").

One secret per replica group authenticates its ranks to their leader and to each other: the
leader's CURVE server key, one CURVE client key per rank (so a rank's session is bound to its
rank), and the rendezvous store's key prefix are all HMAC-SHA256 of the secret under a label,
so every rank derives the same keys and nobody without the secret can derive any of them.

Pods read the secret from the file the operator mounts (``TESSERA_GROUP_SECRET_FILE``, else
``/etc/tessera/group-secret/secret``) and refuse to start without it; a leader that starts its
ranks itself (`tessera serve --tp/--pp`, an offline ``LLM``) writes a random one, mode 0600,
into its private socket folder and names it to them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import zmq
from zmq.utils import z85

from tessera.topology import DEFAULT_GROUP_SECRET_FILE, GROUP_SECRET_FILE_ENV

# Below this a secret could be guessed; the operator and `tessera serve` make 32 random bytes.
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
_LABEL = b"tessera group secret v1: "


class GroupSecretError(RuntimeError):
    """No usable group secret: the message names the file and the variable that points to it."""


def secret_file(environ: Mapping[str, str]) -> str:
    return environ.get(GROUP_SECRET_FILE_ENV) or DEFAULT_GROUP_SECRET_FILE


def read_group_secret(environ: Mapping[str, str]) -> bytes:
    """The secret's bytes as stored (every rank reads the same Secret, so nothing is stripped)."""
    path = secret_file(environ)
    where = f"{path} ({GROUP_SECRET_FILE_ENV} names the file, default {DEFAULT_GROUP_SECRET_FILE})"
    try:
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise GroupSecretError(
            f"no readable group secret at {where}: {exc.strerror or exc}. Rank traffic is "
            "authenticated with it: mount the group's Secret there (the operator does), or point "
            f"{GROUP_SECRET_FILE_ENV} at a file of at least {MIN_SECRET_BYTES} random bytes"
        ) from None
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise GroupSecretError(
            f"the group secret at {where} has {len(secret)} bytes; it needs "
            f"{MIN_SECRET_BYTES} to {MAX_SECRET_BYTES}"
        )
    return secret


def write_group_secret(folder: str) -> str:
    """A fresh random secret in ``folder`` (which must be private to this user), mode 0600."""
    path = os.path.join(folder, "group-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path


def _derive(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, _LABEL + label.encode(), hashlib.sha256).digest()


def _keypair(seed: bytes) -> tuple[bytes, bytes]:
    """A CURVE key pair (Z85 public, Z85 secret) from 32 bytes (any 32 bytes are a secret key)."""
    secret_key = z85.encode(seed)
    return zmq.curve_public(secret_key), secret_key


@dataclass(frozen=True)
class GroupKeys:
    """Everything a group's members derive from its secret."""

    secret: bytes

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> GroupKeys:
        return cls(read_group_secret(environ))

    @cached_property
    def server(self) -> tuple[bytes, bytes]:
        """The leader's CURVE key pair: ranks connect only to a leader that holds it."""
        return _keypair(_derive(self.secret, "rpc server"))

    def rank(self, rank: int) -> tuple[bytes, bytes]:
        """Rank ``rank``'s CURVE client key pair: the leader maps the key back to the rank."""
        return _keypair(_derive(self.secret, f"rpc rank {rank}"))

    @cached_property
    def rendezvous_prefix(self) -> str:
        """The key prefix of every rendezvous-store key (a stranger cannot name the group's keys)."""
        return "tessera-" + _derive(self.secret, "rendezvous").hex()

    def __repr__(self) -> str:  # never the secret in a log or a traceback
        return "GroupKeys(<secret>)"
