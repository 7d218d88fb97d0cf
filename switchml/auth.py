"""Proofs of a job's secret and of a switch's admission token, without sending either.

A job's identity on a switch is a public key, derived from its secret and name:
the Ed25519 key whose seed is HMAC-SHA256(secret, "switchml job key" + name).
Every rank derives the same key pair; the switch learns only the public half
(``Join.key``), so it can check a rank's proof without ever holding the secret,
and a process that knows the name but not the secret derives another key: on
the switch it is another job, which never receives the real job's sums and
never holds one of its ranks.

A join or gather that needs a proof is answered with a ``Challenge``: a random
nonce the switch makes for that request.  The rank answers with ``Prove``: a
signature by the job's key (and, where the switch has an admission token, an
HMAC by the token) over ``transcript(nonce, job, rank, key)``.  A captured
proof is worth nothing on another connection: the nonce is new every time.

The signatures come from the ``cryptography`` package (the ``auth`` extra,
which the ``torch`` extra pulls in); ``AuthUnavailableError`` says so where it
is missing.  HMACs need only the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from .errors import AuthUnavailableError, SwitchMLError

#: Bytes of a challenge's nonce.
NONCE_BYTES = 16
#: Hex digits of a public key (32 bytes) and of a signature (64 bytes).
KEY_HEX = 64
SIGNATURE_HEX = 128
#: Hex digits of an admission proof (HMAC-SHA256).
ADMISSION_HEX = 64
_KEY_LABEL = b"switchml job key\x00"
_TRANSCRIPT_LABEL = b"switchml join proof v2\x00"


def _ed25519():
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise AuthUnavailableError(
            "authenticated jobs need the 'cryptography' package (the 'auth' extra): "
            "pip install 'cryptography>=42'") from None
    return ed25519


def _secret_bytes(secret: str | bytes) -> bytes:
    data = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not data:
        raise SwitchMLError("a job secret must not be empty")
    return data


def new_secret() -> str:
    """A fresh job secret: 256 random bits as hex."""
    return secrets.token_hex(32)


def new_secret_if_available() -> str | None:
    """``new_secret()`` where signatures can be made here; None (the job runs
    open) where the ``cryptography`` package is missing."""
    try:
        check_available()
    except AuthUnavailableError:
        return None
    return new_secret()


class JobKey:
    """A job's signing key, derived from its secret and name (module docstring)."""

    def __init__(self, secret: str | bytes, job: str):
        seed = hmac.new(_secret_bytes(secret), _KEY_LABEL + job.encode(), hashlib.sha256)
        self._private = _ed25519().Ed25519PrivateKey.from_private_bytes(seed.digest())
        #: The public key, as ``Join.key`` carries it: the job's identity on a switch.
        self.public = self._private.public_key().public_bytes_raw().hex()

    def sign(self, transcript: bytes) -> str:
        return self._private.sign(transcript).hex()

    def __repr__(self) -> str:  # never the secret
        return f"JobKey(public={self.public[:16]}...)"


def transcript(nonce: str, job: str, rank: int, key: str | None) -> bytes:
    """What a proof signs: the challenge's nonce and what the request claims."""
    return b"\x00".join((_TRANSCRIPT_LABEL, nonce.encode(), job.encode(),
                         str(rank).encode(), (key or "").encode()))


def verify(key: str, signature: str, message: bytes) -> bool:
    """Whether ``signature`` (hex) is ``key``'s (hex) over ``message``; False for
    anything malformed."""
    ed25519 = _ed25519()
    from cryptography.exceptions import InvalidSignature  # there once _ed25519 is

    try:
        public = ed25519.Ed25519PublicKey.from_public_bytes(bytes.fromhex(key))
        public.verify(bytes.fromhex(signature), message)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def admission_proof(token: bytes, message: bytes) -> str:
    """The HMAC by a switch's admission token over ``message``, as hex."""
    return hmac.new(token, message, hashlib.sha256).hexdigest()


def admitted(token: bytes, proof: str | None, message: bytes) -> bool:
    """Whether ``proof`` is the admission proof of ``message`` by ``token``."""
    return proof is not None and hmac.compare_digest(admission_proof(token, message),
                                                     proof)


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def read_token(path: str) -> bytes:
    """A switch's admission token from a file: its bytes, surrounding white space
    stripped; a clear error for an empty or unreadable file."""
    try:
        with open(path, "rb") as f:
            token = f.read().strip()
    except OSError as exc:
        raise SwitchMLError(f"cannot read the admission token file {path}: {exc}") from None
    if not token:
        raise SwitchMLError(f"the admission token file {path} is empty")
    return token


def token_from_env(environ=None) -> bytes | None:
    """The admission token of ``SWITCHML_SWITCH_TOKEN`` (its value), or of
    ``SWITCHML_SWITCH_TOKEN_FILE`` (a file holding it); None when neither is set."""
    environ = os.environ if environ is None else environ
    if environ.get("SWITCHML_SWITCH_TOKEN", "").strip():
        return environ["SWITCHML_SWITCH_TOKEN"].strip().encode()
    if environ.get("SWITCHML_SWITCH_TOKEN_FILE"):
        return read_token(environ["SWITCHML_SWITCH_TOKEN_FILE"])
    return None


def check_available() -> None:
    """Raise AuthUnavailableError unless signatures can be made and checked here."""
    _ed25519()
