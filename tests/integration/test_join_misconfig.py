"""Misconfiguration fails loudly at ``join()`` (issue 19, part 2), on real ZeroMQ sockets.

Before, each of these trained alone with exit code 0: two peers with different
secrets, an unreachable or malformed peer address, ``join()`` with no peers
outside torchrun.  Now ``join()`` raises after ``join_timeout_s`` (2 s here)
naming the addresses, rejects a malformed address at once, and goes on with
fewer peers only when ``min_peers`` says so.  Peers run as threads of this
process on 127.0.0.1; nothing here is random but the free ports.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

import pytest

import gossipnet

#: Each test waits at most one 2 s join deadline (two in parallel); the rest is slack
#: for a loaded 2-core machine.
pytestmark = pytest.mark.timeout(30)

NET: dict[str, Any] = {
    "heartbeat_interval_s": 0.1,
    "failure_timeout_s": 1.0,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "join_timeout_s": 2.0,
    "collective_timeout_s": 3.0,
    "handle_sigterm": False,
}


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GOSSIPNET_SECRET"):
        monkeypatch.delenv(name, raising=False)


def join_all(calls: list[dict[str, Any]]) -> list[gossipnet.Peer | BaseException]:
    """``join(**kw)`` for each ``kw`` at once, in threads: a peer or what it raised."""

    def one(kw: dict[str, Any]) -> gossipnet.Peer | BaseException:
        try:
            return gossipnet.join(**{**NET, **kw})
        except Exception as err:
            return err

    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(one, calls))


def leave_all(outcomes: list[gossipnet.Peer | BaseException]) -> None:
    for out in outcomes:
        if isinstance(out, gossipnet.Peer):
            out.leave()


def test_different_secrets_both_joins_raise_naming_the_other(
    free_tcp_ports: Callable[[int], list[int]], no_torchrun_env: None
) -> None:
    a, b = (f"tcp://127.0.0.1:{p}" for p in free_tcp_ports(2))
    outcomes = join_all(
        [
            {"peers": [a, b], "listen": a, "peer_id": "a", "secret": b"one"},
            {"peers": [a, b], "listen": b, "peer_id": "b", "secret": b"two"},
        ]
    )
    leave_all(outcomes)
    for out, other, other_id in ((outcomes[0], b, "b"), (outcomes[1], a, "a")):
        assert isinstance(out, gossipnet.JoinError), out
        text = str(out)
        assert f"packets from {other} (claims to be peer {other_id!r}) fail authentication" in text
        assert "a different secret?" in text
        assert "1 of 2 expected peers alive" in text
        assert out.unauthenticated == (f"{other} (claims to be peer {other_id!r})",)
        assert out.missing == ()  # it answered, with the wrong key: not "no answer"
        assert out.alive == (out.alive[0],)


def test_different_run_ids_are_named_as_such(
    free_tcp_ports: Callable[[int], list[int]], no_torchrun_env: None
) -> None:
    a, b = (f"tcp://127.0.0.1:{p}" for p in free_tcp_ports(2))
    outcomes = join_all(
        [
            {"peers": [a, b], "listen": a, "peer_id": "a", "secret": b"s", "run": "exp1"},
            {"peers": [a, b], "listen": b, "peer_id": "b", "secret": b"s", "run": "exp2"},
        ]
    )
    leave_all(outcomes)
    err = outcomes[0]
    assert isinstance(err, gossipnet.JoinError), err
    assert f"packets from {b} (claims to be peer 'b') fail authentication" in str(err)
    assert "a different run id (it claims Config.run='exp2', ours is 'exp1')" in str(err)


def test_unreachable_peer_raises_naming_it(no_torchrun_env: None) -> None:
    with pytest.raises(gossipnet.JoinError) as info:
        gossipnet.join(["tcp://127.0.0.1:1"], listen="tcp://127.0.0.1:0", peer_id="a", **NET)
    assert "1 of 2 expected peers alive after 2.0 s" in str(info.value)
    assert "no answer from tcp://127.0.0.1:1:" in str(info.value)
    assert "min_peers" in str(info.value)  # says how to go on without it on purpose
    assert info.value.missing == ("tcp://127.0.0.1:1",)
    assert info.value.alive == ("a",)


@pytest.mark.timeout(10)  # a 30 s join deadline must not be waited out: rejected at once
@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("localhost:27002", "has no scheme; write e.g. 'tcp://localhost:27002'"),
        ("tcp://127.0.0.1:99999", "needs a port in 1..65535"),
        ("tcp://127.0.0.1:0", "needs a port in 1..65535"),
        ("tcp://0.0.0.0:27002", "wildcard host"),
        ("tcp://127.0.0.1", "must be tcp://host:port"),
        ("udp://127.0.0.1:27002", "served by the udp backend"),
    ],
)
def test_malformed_peer_address_is_rejected_at_once(
    address: str, why: str, no_torchrun_env: None
) -> None:
    with pytest.raises(gossipnet.ConfigError, match="peer address") as info:
        gossipnet.join([address], listen="tcp://127.0.0.1:0", **{**NET, "join_timeout_s": 30.0})
    assert repr(address) in str(info.value)
    assert why in str(info.value)


def test_a_string_for_peers_is_rejected(no_torchrun_env: None) -> None:
    with pytest.raises(gossipnet.ConfigError, match="list of addresses"):
        gossipnet.join("tcp://127.0.0.1:27002", **NET)  # type: ignore[arg-type]


def test_min_peers_goes_on_with_fewer_and_names_the_missing(
    free_tcp_ports: Callable[[int], list[int]],
    no_torchrun_env: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A preemptible fleet: c is down; a and b go on together, saying c is missing."""
    a, b, c = (f"tcp://127.0.0.1:{p}" for p in free_tcp_ports(3))
    caplog.set_level(logging.WARNING, logger="gossipnet.peer")
    outcomes = join_all(
        [
            {"peers": [a, b, c], "listen": a, "peer_id": "a", "secret": b"k", "min_peers": 2},
            {"peers": [a, b, c], "listen": b, "peer_id": "b", "secret": b"k", "min_peers": 2},
        ]
    )
    try:
        for out in outcomes:
            assert isinstance(out, gossipnet.Peer), out
            assert out.alive_peers() == ["a", "b"]
    finally:
        leave_all(outcomes)
    warnings = [r.getMessage() for r in caplog.records if "going on with them" in r.getMessage()]
    assert len(warnings) == 2, warnings
    for text in warnings:
        assert "2 of 3 expected peers alive" in text
        assert text.splitlines()[1] == f"  no answer from {c}"
        assert "Config.min_peers=2" in text


def test_min_peers_not_met_still_raises(no_torchrun_env: None) -> None:
    with pytest.raises(gossipnet.JoinError, match="1 of 3 expected peers alive"):
        gossipnet.join(
            ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"],
            listen="tcp://127.0.0.1:0",
            min_peers=2,
            **NET,
        )


def test_min_peers_above_the_expected_is_a_config_error(no_torchrun_env: None) -> None:
    with pytest.raises(gossipnet.ConfigError, match="min_peers=3 exceeds the 2 peers"):
        gossipnet.join(["tcp://127.0.0.1:1"], listen="tcp://127.0.0.1:0", min_peers=3, **NET)


def test_no_peers_outside_torchrun_is_an_error_and_peers_empty_is_solo(
    no_torchrun_env: None,
) -> None:
    with pytest.raises(gossipnet.ConfigError, match=r"pass peers=\[\] to train alone on purpose"):
        gossipnet.join(**NET)
    with gossipnet.join(peers=[], **NET) as solo:  # the explicit solo peer
        assert solo.alive_peers() == [solo.peer_id]


def test_all_peers_up_join_returns_without_a_warning(
    free_tcp_ports: Callable[[int], list[int]],
    no_torchrun_env: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing changes when the peers come: no error, no warning, no deadline waited."""
    a, b = (f"tcp://127.0.0.1:{p}" for p in free_tcp_ports(2))
    caplog.set_level(logging.WARNING, logger="gossipnet")
    outcomes = join_all(
        [
            {"peers": [a, b], "listen": a, "peer_id": "a", "secret": b"k", "join_timeout_s": 60},
            {"peers": [a, b], "listen": b, "peer_id": "b", "secret": b"k", "join_timeout_s": 60},
        ]
    )
    try:
        assert all(isinstance(out, gossipnet.Peer) for out in outcomes), outcomes
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    finally:
        leave_all(outcomes)
