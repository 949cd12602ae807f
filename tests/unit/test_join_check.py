"""Misconfiguration diagnostics without sockets (issue 19, part 2).

What a rejected packet claims about its sender (``WireCodec.suspects``: bounded,
rate-limited, never trusted), the text ``join()`` builds from it
(``_join_check``), peer-address checks, the no-peers rule and the no-secret
warning.  The same paths on real sockets: tests/integration/test_join_misconfig.py.
"""

from __future__ import annotations

import logging

import pytest

import gossipnet
import gossipnet._join
from gossipnet import Config, ConfigError, FakeClock
from gossipnet.runtime import _join_check
from gossipnet.runtime import join as _join
from gossipnet.runtime.kinds import NodeKind
from gossipnet.transport import check_peer_address
from gossipnet.transport.base import Buffer
from gossipnet.transport.wire import Suspect, WireCodec

#: What a node takes under the run key: its HELLO (the runtime's introduction).
INTRO = frozenset({NodeKind.HELLO})


def receiver(secret: bytes, clock: FakeClock | None = None, **config: object) -> WireCodec:
    """A codec that takes HELLOs as introductions, as a node's does."""
    cfg = Config(**config)  # type: ignore[arg-type]
    return WireCodec(secret, cfg, "a", clock=clock or FakeClock(), intro_kinds=INTRO)


def hello(secret: bytes, src: str, addr: str, **config: object) -> list[Buffer]:
    """A HELLO (an introduction: signed with the run key) from a codec made so."""
    codec = WireCodec(secret, Config(**config), src)  # type: ignore[arg-type]
    return list(codec.encode(NodeKind.HELLO, {"addr": addr}, intro=True))


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GOSSIPNET_SECRET"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ----------------------------------------------------------------------------- wire
@pytest.mark.parametrize(
    ("theirs", "reject", "reason", "same_key", "run"),
    [
        # another secret or run: another run key, whose fingerprint is no key id of ours
        ({"secret": b"two"}, "unknown_key", "mac", False, "gossipnet"),
        ({"run": "other"}, "unknown_key", "mac", False, "other"),
        # our run key's fingerprint, a 24-byte frame where ours are 36
        ({"mac": "hmac-sha256"}, "mac_size", "mac_size", True, "gossipnet"),
    ],
)
def test_rejected_packet_records_what_its_sender_claims(
    theirs: dict[str, object], reject: str, reason: str, same_key: bool, run: str
) -> None:
    ours = receiver(b"one")
    secret = theirs.pop("secret", b"one")
    frames = hello(secret, "b", "tcp://10.0.0.2:7000", **theirs)  # type: ignore[arg-type]
    assert ours.decode(frames) is None
    assert ours.rejects == {reject: 1}
    assert list(ours.suspects.values()) == [
        Suspect(src="b", addr="tcp://10.0.0.2:7000", run=run, reason=reason, same_key=same_key)
    ]


def test_an_unknown_keys_packet_is_a_suspect_only_as_an_introduction() -> None:
    """A packet under a key id we do not know is dropped either way; only one claiming
    an introduction kind names a suspect: any other may be a member's own packet that
    overtook its introduction (routine), not a misconfigured peer."""
    ours = receiver(b"one")
    member = WireCodec(b"one", Config(), "b")
    member.bind("a", ours.epoch, ours.identity.public)  # it knows us, we do not know it
    other = WireCodec(b"two", Config(), "c")
    other.bind("a", ours.epoch, ours.identity.public)
    for codec in (member, other):
        frames = codec.encode(NodeKind.HEARTBEAT, {"addr": f"tcp://h:{codec.src}"}, dst="a")
        assert ours.decode(frames) is None
    assert ours.rejects == {"unknown_key": 2}
    assert not ours.suspects


def test_same_key_with_a_bad_tag_is_told_apart() -> None:
    """hmac-sha256 and blake2b frames are the same length: the key fingerprint
    matches (same secret and run) and only the tag fails."""
    ours = receiver(b"k", mac="blake2b")
    assert ours.decode(hello(b"k", "b", "tcp://h:1", mac="hmac-sha256")) is None
    (suspect,) = ours.suspects.values()
    assert (suspect.reason, suspect.same_key) == ("mac", True)


def test_suspects_are_bounded_rate_limited_and_never_accepted() -> None:
    clock = FakeClock()
    ours = receiver(b"one", clock)
    for i in range(20):
        assert ours.decode(hello(b"two", f"x{i}", f"tcp://h:{i + 1}")) is None
        assert ours.decode(hello(b"two", f"y{i}", "tcp://h:9")) is None  # same instant
        clock.advance(0.02)
    assert ours.rejects == {"unknown_key": 40}
    assert ours.accepted == 0
    # one parse per 10 ms: the y packets, 0 s after an x, were not parsed
    assert [s.src for s in ours.suspects.values()] == [f"x{i}" for i in range(12, 20)]


def test_suspect_claims_are_cut_short_and_odd_headers_kept_as_unknown() -> None:
    clock = FakeClock()
    ours = receiver(b"one", clock)
    assert ours.decode(hello(b"two", "b" * 500, "tcp://h:1")) is None
    clock.advance(1)
    # our run key's fingerprint (an introduction's frame) with a bad tag: a suspect
    # whatever its header, which here does not parse
    fp = bytes(hello(b"one", "c", "tcp://h:2")[2])[-8:]
    assert ours.decode([b"\xc1not msgpack", b"", bytes(ours.mac_bytes - 8) + fp]) is None
    assert ours.rejects == {"unknown_key": 1, "mac": 1}
    first, second = ours.suspects.values()
    assert first.src == "b" * 128
    assert (second.src, second.addr, second.run, second.same_key) == (None, None, None, True)


# ----------------------------------------------------------------------------- text
def snapshot(**kw: object) -> _join_check.JoinSnapshot:
    base: dict[str, object] = {
        "peer_id": "a",
        "address": "tcp://h:1",
        "alive": ("a",),
        "alive_addresses": frozenset({"tcp://h:1"}),
        "bootstrap": ("tcp://h:2", "tcp://h:3"),
        "suspects": (),
        "run": "r",
        "expected": 3,
        "timeout_s": 2.0,
    }
    return _join_check.JoinSnapshot(**{**base, **kw})  # type: ignore[arg-type]


def test_join_error_names_silent_and_unauthenticated_addresses_apart() -> None:
    suspects = (
        Suspect("b", None, "r", "mac", False),  # a data packet: no address
        Suspect("b", "tcp://h:2", "r", "mac", False),  # its HELLO: the address wins
    )
    err = _join_check.join_error(snapshot(suspects=suspects))
    assert isinstance(err, gossipnet.JoinError)
    assert err.missing == ("tcp://h:3",)
    assert err.unauthenticated == ("tcp://h:2 (claims to be peer 'b')",)
    text = str(err)
    assert "peer a: 1 of 3 expected peers alive after 2.0 s" in text
    who = "packets from tcp://h:2 (claims to be peer 'b')"
    assert f"{who} fail authentication: a different secret?" in text
    assert "no answer from tcp://h:3:" in text
    assert "tcp://h:2:" not in text  # it answered, with another key


def test_causes_and_long_lists() -> None:
    causes = _join_check.unauthenticated(
        [
            Suspect("b", None, "r", "mac_size", True),
            Suspect("c", None, "r", "mac", True),
            Suspect("d", None, "other", "mac", False),
            Suspect(None, None, None, "mac", False),
        ],
        "r",
    )
    assert causes == {
        "a sender that claims to be peer 'b'": "a different Config.mac (its MAC frames have"
        " another length)?",
        "a sender that claims to be peer 'c'": "same key but a bad tag: a different"
        " Config.mac, or corrupted or forged packets?",
        "a sender that claims to be peer 'd'": "a different run id (it claims"
        " Config.run='other', ours is 'r')?",
        "a sender whose header does not parse": "a different secret?",
    }
    many = tuple(f"tcp://h:{i}" for i in range(10, 30))
    text, missing, _ = _join_check.shortfall_details(snapshot(bootstrap=many, expected=21))
    assert len(missing) == 20
    assert text.endswith(
        "and 12 more: is a peer running there, is the host:port right (the"
        " peer's listen address) and reachable from here (firewall, routes)?"
    )


# ----------------------------------------------------------------------------- arguments
def test_check_peer_address_accepts_what_can_be_dialled() -> None:
    for good in ("tcp://10.0.0.2:7000", "tcp://[::1]:7", "tcp://host.example:65535"):
        assert check_peer_address(good, listen="tcp://0.0.0.0:0") == good
    assert check_peer_address("ipc:///tmp/x", listen="tcp://127.0.0.1:0") == "ipc:///tmp/x"
    assert check_peer_address("mem://p1", listen="mem://") == "mem://p1"
    for bad in ("ftp://h:1", "ipc://", "mem://*", "tcp://h:x", "tcp://*:7000", 7000):
        with pytest.raises(ConfigError, match="peer address"):
            check_peer_address(bad)


def test_resolve_join_rules(clean_env: pytest.MonkeyPatch) -> None:
    def resolve(peers: object, wait_for: object = None) -> _join.JoinPlan:
        return _join.resolve_join(
            peers,  # type: ignore[arg-type]
            None,
            secret=None,
            config=None,
            wait_for=wait_for,  # type: ignore[arg-type]
            overrides={},
        )

    with pytest.raises(ConfigError, match="not under torchrun"):
        resolve(None)
    assert resolve([]).bootstrap == []  # a solo peer, on purpose
    with pytest.raises(ConfigError, match="wait_for must be an int >= 1"):
        resolve([], wait_for=0)
    with pytest.raises(ConfigError, match="list of addresses"):
        resolve("tcp://h:1")
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("MASTER_PORT", "65535")  # rank 0 would listen on 65536
    with pytest.raises(ConfigError, match=r"'tcp://127\.0\.0\.1:65536' needs a port"):
        resolve(None)


def test_min_peers_is_validated() -> None:
    assert Config(min_peers=2).min_peers == 2
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError, match="min_peers"):
            Config(min_peers=bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- no secret
def plan(listen: str, secret: bytes | None) -> _join.JoinPlan:
    return _join.JoinPlan(
        config=Config(), listen=listen, peer_id="p", bootstrap=[], secret=secret,
        expected_peers=None,
    )  # fmt: skip


def test_no_secret_beyond_loopback_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gossipnet.peer")
    _join.warn_if_exposed(plan("tcp://0.0.0.0:29501", None))
    _join.warn_if_exposed(plan("udp://10.0.0.2:7000", b""))  # empty is no secret
    quiet = ("tcp://127.0.0.1:0", "tcp://[::1]:7", "tcp://localhost:7", "ipc:///tmp/x", "mem://")
    for listen in quiet:
        _join.warn_if_exposed(plan(listen, None))
    _join.warn_if_exposed(plan("tcp://0.0.0.0:29501", b"k"))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("peer p listens on tcp://0.0.0.0:29501 without a secret")
    assert "GOSSIPNET_SECRET" in messages[0]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


class _Stop(Exception):
    pass


def test_join_under_torchrun_without_a_secret_warns_before_binding(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torchrun mode listens on 0.0.0.0; the warning comes from ``join()`` itself
    (the peer is stubbed out, so nothing binds a non-loopback address here)."""
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")

    def no_peer(**_kw: object) -> None:
        raise _Stop

    clean_env.setattr(gossipnet._join, "Peer", no_peer)  # join() builds the Peer there
    caplog.set_level(logging.WARNING, logger="gossipnet.peer")
    with pytest.raises(_Stop):
        gossipnet.join()
    assert "peer rank0 listens on tcp://0.0.0.0:29501 without a secret" in caplog.text
    caplog.clear()
    with pytest.raises(_Stop):
        gossipnet.join(secret=b"k")
    assert caplog.text == ""


def test_a_peer_that_bootstraps_from_nobody_is_told_who_should_dial_it() -> None:
    """torchrun's rank 0 lists no peers; the others never came."""
    text, missing, bad = _join_check.shortfall_details(snapshot(bootstrap=(), expected=4))
    assert (missing, bad) == ((), {})
    assert text.endswith(
        "3 peer(s) never said hello: are they started, with tcp://h:1 among their peers"
        " (under torchrun: MASTER_ADDR:MASTER_PORT+1), and can they reach it?"
    )
