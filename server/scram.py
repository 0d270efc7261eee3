"""SCRAM-SHA-256 (RFC 5802 / 7677) as Postgres uses it: verifiers, server and client exchanges."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import unicodedata
from dataclasses import dataclass

DEFAULT_ITERATIONS = 4096
MECHANISM = "SCRAM-SHA-256"
_VERIFIER = re.compile(
    r"^SCRAM-SHA-256\$(\d+):([A-Za-z0-9+/=]+)\$([A-Za-z0-9+/=]+):([A-Za-z0-9+/=]+)$"
)


class ScramError(Exception):
    """The exchange is malformed or the proof is wrong."""


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: str) -> bytes:
    try:
        return base64.b64decode(s, validate=True)
    except ValueError:
        raise ScramError("bad base64 in SCRAM message") from None


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def _normalize(password: str) -> bytes:
    # Postgres applies SASLprep and falls back to the raw bytes when it fails;
    # NFKC is SASLprep's normalisation step, which covers passwords people type.
    return unicodedata.normalize("NFKC", password).encode("utf-8")


@dataclass(frozen=True)
class Verifier:
    """What the server stores instead of a password."""

    iterations: int
    salt: bytes
    stored_key: bytes
    server_key: bytes

    @classmethod
    def parse(cls, text: str) -> Verifier:
        m = _VERIFIER.match(text)
        if not m:
            raise ScramError("not a SCRAM-SHA-256 verifier")
        return cls(int(m[1]), _unb64(m[2]), _unb64(m[3]), _unb64(m[4]))

    def __str__(self) -> str:
        return (
            f"{MECHANISM}${self.iterations}:{_b64(self.salt)}"
            f"${_b64(self.stored_key)}:{_b64(self.server_key)}"
        )


def _salted_password(password: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", _normalize(password), salt, iterations)


def make_verifier(
    password: str, salt: bytes | None = None, iterations: int = DEFAULT_ITERATIONS
) -> Verifier:
    """The verifier Postgres would store for `password` (same format as pg_authid)."""
    salt = secrets.token_bytes(16) if salt is None else salt
    salted = _salted_password(password, salt, iterations)
    client_key = _hmac(salted, b"Client Key")
    return Verifier(
        iterations=iterations,
        salt=salt,
        stored_key=hashlib.sha256(client_key).digest(),
        server_key=_hmac(salted, b"Server Key"),
    )


def _attributes(message: str) -> dict[str, str]:
    out = {}
    for part in message.split(","):
        if len(part) < 2 or part[1] != "=":
            raise ScramError(f"malformed SCRAM attribute {part[:20]!r}")
        out[part[0]] = part[2:]
    return out


class ScramServer:
    """One server-side exchange: client-first → server-first, client-final → server-final.

    With `verifier=None` (unknown user) the exchange runs against a fake
    verifier derived from `mock_seed`, so that a client cannot tell from the
    exchange itself whether the user exists; `verify_final` then always fails.
    """

    def __init__(self, verifier: Verifier | None, mock_seed: bytes = b"") -> None:
        if verifier is None:
            fake_salt = hashlib.sha256(b"dp-proxy-mock-salt" + mock_seed).digest()[:16]
            self._verifier = Verifier(DEFAULT_ITERATIONS, fake_salt, b"\0" * 32, b"\0" * 32)
            self._real = False
        else:
            self._verifier = verifier
            self._real = True
        self._client_first_bare = ""
        self._server_first = ""
        self._nonce = ""

    def handle_client_first(self, data: bytes) -> bytes:
        """Parse the client-first message; return the server-first message."""
        text = data.decode("utf-8", errors="strict")
        gs2, sep, rest = text.partition(",")
        if not sep or gs2 not in ("n", "y"):
            # 'p' would ask for channel binding, which we never advertise
            raise ScramError("unsupported channel-binding flag in SCRAM client-first message")
        authzid, sep, bare = rest.partition(",")
        if not sep or authzid:
            raise ScramError("authorization identity is not supported")
        attrs = _attributes(bare)
        if "r" not in attrs or not attrs["r"]:
            raise ScramError("SCRAM client-first message has no nonce")
        self._client_first_bare = bare
        self._gs2_header = f"{gs2},,"
        self._nonce = attrs["r"] + _b64(secrets.token_bytes(18))
        v = self._verifier
        self._server_first = f"r={self._nonce},s={_b64(v.salt)},i={v.iterations}"
        return self._server_first.encode()

    def verify_final(self, data: bytes) -> bytes:
        """Check the client's proof; return the server-final message or raise ScramError."""
        text = data.decode("utf-8", errors="strict")
        without_proof, sep, proof_part = text.rpartition(",p=")
        if not sep:
            raise ScramError("SCRAM client-final message has no proof")
        attrs = _attributes(without_proof)
        if attrs.get("r") != self._nonce:
            raise ScramError("SCRAM nonce mismatch")
        if _unb64(attrs.get("c", "")) != self._gs2_header.encode():
            raise ScramError("SCRAM channel-binding data mismatch")
        auth_message = f"{self._client_first_bare},{self._server_first},{without_proof}".encode()
        proof = _unb64(proof_part)
        v = self._verifier
        signature = _hmac(v.stored_key, auth_message)
        if len(proof) != len(signature):
            raise ScramError("password authentication failed")
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        ok = hmac.compare_digest(hashlib.sha256(client_key).digest(), v.stored_key)
        if not (ok and self._real):
            raise ScramError("password authentication failed")
        return f"v={_b64(_hmac(v.server_key, auth_message))}".encode()


class ScramClient:
    """The client side, used to log in to the backend Postgres."""

    def __init__(self, password: str, nonce: str | None = None) -> None:
        self._password = password
        self._client_nonce = nonce or _b64(secrets.token_bytes(18))
        self._client_first_bare = f"n=,r={self._client_nonce}"
        self._auth_message = b""
        self._server_key = b""

    def client_first(self) -> bytes:
        return f"n,,{self._client_first_bare}".encode()

    def client_final(self, server_first: bytes) -> bytes:
        text = server_first.decode()
        attrs = _attributes(text)
        nonce, salt, iterations = attrs.get("r", ""), attrs.get("s", ""), attrs.get("i", "")
        if not nonce.startswith(self._client_nonce) or not iterations.isdigit():
            raise ScramError("bad SCRAM server-first message")
        salted = _salted_password(self._password, _unb64(salt), int(iterations))
        client_key = _hmac(salted, b"Client Key")
        stored_key = hashlib.sha256(client_key).digest()
        self._server_key = _hmac(salted, b"Server Key")
        without_proof = f"c={_b64(b'n,,')},r={nonce}"
        self._auth_message = f"{self._client_first_bare},{text},{without_proof}".encode()
        signature = _hmac(stored_key, self._auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        return f"{without_proof},p={_b64(proof)}".encode()

    def verify_server_final(self, server_final: bytes) -> None:
        attrs = _attributes(server_final.decode())
        expected = _hmac(self._server_key, self._auth_message)
        if not hmac.compare_digest(_unb64(attrs.get("v", "")), expected):
            raise ScramError("the backend's SCRAM server signature is wrong")
