"""Per-peer identity: a key pair per incarnation, pairwise packet keys per peer.

Why: the run secret admits a process to the run; it must not let one member speak
for another.  Each incarnation of a peer (one process life) draws an X25519 key
pair; its public key travels in its *introduction* (a HELLO signed with the run
key, the only packets that are).  Every other packet is signed with a key that
only its sender and its receiver can compute: the X25519 agreement of the two
peers' keys, expanded by HKDF-SHA256 (salted with the run key, so the pair keys
of another run or secret differ) into one key per direction.  A member holding
the secret therefore cannot forge a packet from another member: it lacks the
private key behind that member's public key.  The per-packet MAC stays the
symmetric one of :mod:`.mac` (AES-GMAC by default), so authenticating a data
packet costs what it did under a shared key; a packet for ``k`` peers carries
``k`` tags (:mod:`.wire`).

A *key id* (8 bytes, a keyed hash of the public key and the peer id under the run
key) closes every pairwise MAC frame, so a receiver finds the sender's keys with
one dictionary lookup before it hashes anything; it names no key to an outsider.

Which public key belongs to which peer id is the runtime's decision (first
come, first bound; a name changes key only once its holder has gone silent:
:mod:`gossipnet.runtime.admission`); this module holds the bound sessions and
derives their keys.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gossipnet.transport.mac import Signer, make_signer

__all__ = ("KEY_ID_BYTES", "PUBLIC_KEY_BYTES", "Identity", "Keyring", "Session", "key_id")

#: Bytes of a raw X25519 public key.
PUBLIC_KEY_BYTES = 32
#: Bytes of a key id closing every MAC frame.
KEY_ID_BYTES = 8


def key_id(run_key: bytes, peer_id: str, public: bytes) -> bytes:
    """The key id of ``peer_id``'s ``public`` key under ``run_key``.

    The peer id is part of it so that a member announcing another's public key
    under its own name gets another key id (it still cannot use that key: it
    lacks the private half), never the genuine peer's.
    """
    h = hashlib.blake2b(key=run_key, digest_size=KEY_ID_BYTES, person=b"gossipnet-kid")
    h.update(len(peer_id.encode()).to_bytes(2, "big"))
    h.update(peer_id.encode())
    h.update(public)
    return h.digest()


def _hkdf(shared: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(shared)


class Identity:
    """This incarnation's key pair (never leaves the process) and public key id.

    Args:
        run_key: the run key (the MAC key of introductions).
        peer_id: our id.
    """

    def __init__(self, run_key: bytes, peer_id: str) -> None:
        self._private = X25519PrivateKey.generate()
        self.peer_id = peer_id
        self.public = self._private.public_key().public_bytes_raw()
        self.key_id = key_id(run_key, peer_id, self.public)

    def agree(self, public: bytes) -> bytes:
        """The X25519 shared secret with a peer's ``public`` key.

        Raises:
            ValueError: ``public`` is not a valid X25519 public key (wrong length, or
                a low-order point whose agreement would be all zeros).
        """
        return self._private.exchange(X25519PublicKey.from_public_bytes(public))


@dataclass(slots=True, eq=False)
class Session:
    """The keys between us and one bound peer incarnation.

    Attributes:
        peer_id, epoch, public: who the peer is (its id, incarnation, public key).
        key_id: its key id (closes the MAC frames it sends us).
        send: signs what we send it.
        recv: verifies what it sends us.
        token_out, token_in: what a packet over a private local channel carries in
            place of a MAC (:meth:`gossipnet.transport.wire.WireCodec.decode`): a
            per-direction secret, so a member on the same host cannot pass for
            another without reading that process's memory.
    """

    peer_id: str
    epoch: int
    public: bytes
    key_id: bytes
    send: Signer
    recv: Signer
    token_out: bytes
    token_in: bytes
    pinned: bool = field(default=False)


class Keyring:
    """The sessions of one codec, by peer id and by key id.

    Args:
        me: our identity.
        run_key: salts the pair keys (another run or secret: other keys).
        mac: the MAC algorithm (``Config.mac``).
    """

    def __init__(self, me: Identity, run_key: bytes, mac: str) -> None:
        self.me = me
        self._run_key = run_key
        self._mac = mac
        self.by_id: dict[str, Session] = {}
        self.by_kid: dict[bytes, Session] = {}

    def bind(self, peer_id: str, epoch: int, public: bytes, *, pinned: bool = False) -> Session:
        """Bind ``peer_id`` to ``public`` (its incarnation ``epoch``): derive the keys.

        Replaces any session of ``peer_id``; whether it may is the caller's rule.

        Raises:
            ValueError: ``public`` is not a usable X25519 public key, or it is ours.
        """
        if type(public) is not bytes or len(public) != PUBLIC_KEY_BYTES:
            raise ValueError(f"a public key is {PUBLIC_KEY_BYTES} bytes")
        if public == self.me.public or peer_id == self.me.peer_id:
            raise ValueError("that is our own key or id")
        shared = self.me.agree(public)
        if not any(shared):
            raise ValueError("low-order public key")
        kid = key_id(self._run_key, peer_id, public)
        mine = self.me.key_id
        out_key = _hkdf(shared, self._run_key, b"gossipnet/pair/v1" + mine + kid)
        in_key = _hkdf(shared, self._run_key, b"gossipnet/pair/v1" + kid + mine)
        send, recv = make_signer(self._mac, out_key), make_signer(self._mac, in_key)
        size = send.size
        session = Session(
            peer_id,
            epoch,
            public,
            kid,
            send,
            recv,
            _hkdf(out_key, b"", b"gossipnet/local/v1", size),
            _hkdf(in_key, b"", b"gossipnet/local/v1", size),
            pinned,
        )
        self.unbind(peer_id)
        self.by_id[peer_id] = session
        self.by_kid[kid] = session
        return session

    def unbind(self, peer_id: str) -> Session | None:
        """Forget ``peer_id``'s session (its packets are dropped as ``unknown_key``)."""
        old = self.by_id.pop(peer_id, None)
        if old is not None:
            self.by_kid.pop(old.key_id, None)
        return old

    def __len__(self) -> int:
        return len(self.by_id)
