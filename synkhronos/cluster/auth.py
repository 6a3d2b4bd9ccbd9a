"""The job's secret, and the proof that a peer holds it: one HMAC for sentinels and joiners alike.

A machine proves it belongs to the job by answering a fresh nonce with
HMAC-SHA256(secret, nonce + its identity): the secret never crosses the
wire, and a replayed answer fails against the next nonce.
"""

import hashlib
import hmac
import secrets

SECRET_BYTES = 32
NONCE_BYTES = 32


def new_secret():
    """A fresh per-job secret: sent to the node masters over MPI, never over the liveness port."""
    return secrets.token_bytes(SECRET_BYTES)


def mac(secret, nonce, ident):
    """The proof for ``nonce`` of a peer named ``ident`` (bytes) that holds ``secret``."""
    return hmac.new(secret, nonce + ident, hashlib.sha256).digest()


def proves(secret, nonce, ident, answer):
    """Whether ``answer`` is the proof ``mac`` gives (compared in constant time)."""
    return hmac.compare_digest(answer, mac(secret, nonce, ident))


def recv_exact(sock, n):
    """Exactly ``n`` bytes from ``sock``; OSError if it closes first."""
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise OSError("connection closed")
        out += got
    return out
