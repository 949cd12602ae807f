"""SPARQ-SGD's pure parts: the operator C(x), the trigger, estimate versions, parsers.

C(x) must be contractive (E||x - C(x)||^2 <= (1 - w)||x||^2, SPARQ's assumption),
measured here on random inputs; a holder's copy must equal the sender's estimate
bit for bit once its missing DELTAs were replayed or its block refreshed; and
every parser must turn malformed input into None (a counted drop), never raise.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from gossipnet import ConfigError, SparQ
from gossipnet.collectives.sparq import codec
from gossipnet.collectives.sparq.codec import Layout
from gossipnet.collectives.sparq.estimates import HeldEstimate, OwnEstimate


def omega_bound(layout: Layout) -> float:
    """The contraction the module doc promises: kept fraction minus rounding's share."""
    frac = min(layout.keep_of(b) / (hi - lo) for b in range(layout.nblocks)
               for lo, hi in [layout.bounds(b)])  # fmt: skip
    return frac * (1.0 - layout.keep / (4 * 127.0**2))


@pytest.mark.parametrize("density", [0.01, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("numel", [1, 257, 10_000, 70_001])
def test_operator_is_contractive_on_random_inputs(density: float, numel: int) -> None:
    layout = Layout.for_payload(numel, density, 1024)
    gen = torch.Generator().manual_seed(numel)
    w = omega_bound(layout)
    assert w > 0
    for draw in range(20):
        x = torch.randn(numel, generator=gen)
        if draw % 3 == 1:  # heavy tails
            x = x**3
        if draw % 3 == 2:  # mostly zeros
            x = x * (torch.rand(numel, generator=gen) < 0.05)
        cx = codec.decompress(codec.compress(x, layout), layout)
        err, norm = float((x - cx).square().sum()), float(x.square().sum())
        assert err <= (1.0 - w) * norm + 1e-9 * (norm + 1), (draw, err / max(norm, 1e-30))
    assert codec.decompress(codec.compress(torch.zeros(numel), layout), layout).abs().sum() == 0


def test_layout_fits_a_packet_and_keeps_density() -> None:
    layout = Layout.for_payload(1_000_000, 0.05, 1024)
    assert 4 + 3 * layout.keep <= 1024
    assert layout.keep / layout.block == pytest.approx(0.05, rel=0.05)
    assert 4 * layout.segment <= 1024
    big = Layout.for_payload(10_000_000, 0.001, 64 * 1024)
    assert big.block == 65536  # u16 offsets cap a block
    with pytest.raises(ValueError, match="layout"):
        Layout(10, 4, 5, 2)


def test_trigger_threshold_grows_as_documented() -> None:
    s = SparQ(threshold_c0=2.0, threshold_eps=0.25)
    got = [s.threshold(t, 0.1) for t in range(5)]
    want = [2.0 * (t + 1) ** 0.75 * 0.01 for t in range(5)]
    assert got == pytest.approx(want)
    assert all(a < b for a, b in itertools.pairwise(got))
    assert SparQ().threshold(100, 1.0) == 0.0  # c0 = 0: send whenever the model moved
    assert SparQ(threshold_c0=1.0, threshold_eps=1.0).threshold(50, 2.0) == 4.0  # constant


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"gamma": 0.0}, "gamma"),
        ({"threshold_c0": -1.0}, "threshold_c0"),
        ({"threshold_c0": math.nan}, "threshold_c0"),
        ({"threshold_eps": 0.0}, "threshold_eps"),
        ({"history": 0}, "history"),
        ({"repair_wait_s": -1.0}, "repair_wait_s"),
    ],
)
def test_sparq_settings_are_checked(kwargs: dict[str, float], what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        SparQ(**kwargs)  # type: ignore[arg-type]


def _send(own: OwnEstimate, x: torch.Tensor, rnd: int) -> list[tuple[dict, bytes]]:
    """A triggered round's DELTAs, applied to ``own`` as the exchange does."""
    comp = codec.compress(x - own.vec, own.layout)
    out = []
    for _, fields, payload in codec.delta_packets(comp, own.layout, own.versions, rnd):
        own.apply(fields, payload)
        out.append((fields, payload))
    return out


def _deliver(held: HeldEstimate, pkts: list[tuple[dict, bytes]]) -> list[str]:
    outcomes = []
    for fields, payload in pkts:
        parsed = codec.parse_delta(fields, payload, held.layout)
        assert parsed is not None
        outcomes.append(held.apply_delta(*parsed))
    return outcomes


def _repair(own: OwnEstimate, held: HeldEstimate) -> set[str]:
    hows = set()
    for b in held.behind(own.versions):
        how, pkts = own.repair(int(b), int(held.versions[b]))
        hows.add(how)
        for fields, payload in pkts:
            if how == "replay":
                _deliver(held, [(fields, payload)])
            else:
                parsed = codec.parse_refresh(fields, payload, held.layout)
                assert parsed is not None
                held.apply_refresh(*parsed)
    return hows


def test_a_copy_is_exact_and_repairs_by_replay_then_by_refresh() -> None:
    layout = Layout.for_payload(5000, 0.05, 512)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=gen)
    own, held = OwnEstimate(x, layout, history=3), HeldEstimate(layout)
    assert not held.known
    assert held.behind(own.versions).size == layout.nblocks
    assert _repair(own, held) == {"refresh"}  # first contact: exact refresh
    assert held.known
    assert torch.equal(held.vec, own.vec)
    for rnd in range(4):  # lossless: bit-identical every round
        x = x + 0.1 * torch.randn(5000, generator=gen)
        assert set(_deliver(held, _send(own, x, rnd))) == {"applied"}
        assert torch.equal(held.vec, own.vec)
    # lose every other packet of two rounds: behind, then replayed (history 3)
    for rnd in (4, 5):
        x = x + 0.1 * torch.randn(5000, generator=gen)
        _deliver(held, _send(own, x, rnd)[::2])
    assert held.behind(own.versions).size > 0
    assert _repair(own, held) == {"replay"}
    assert torch.equal(held.vec, own.vec)
    assert held.behind(own.versions).size == 0
    # a packet replayed twice is a counted duplicate, not a second addition
    pkts = _send(own, x + 1.0, 6)
    assert _deliver(held, pkts) == ["applied"] * len(pkts)
    assert _deliver(held, pkts[:1]) == ["duplicate"]
    # lose four rounds entirely (more than history): exact refresh
    for rnd in range(7, 11):
        x = x + 0.1 * torch.randn(5000, generator=gen)
        _send(own, x, rnd)
    assert "refresh" in _repair(own, held)
    assert torch.equal(held.vec, own.vec)


def test_refresh_segments_in_any_order_complete_a_block_once() -> None:
    layout = Layout.for_payload(3000, 0.1, 256)
    own = OwnEstimate(torch.arange(3000.0), layout, history=2)
    held = HeldEstimate(layout)
    _, pkts = own.repair(1, -1)
    assert len(pkts) > 2
    parsed = [codec.parse_refresh(f, p, layout) for f, p in pkts]
    done = [held.apply_refresh(*p) for p in reversed(parsed)]  # type: ignore[misc]
    assert done == [False] * (len(pkts) - 1) + [True]
    assert held.versions[1] == 0
    assert held.versions[0] == -1
    lo, hi = layout.bounds(1)
    assert torch.equal(held.vec[lo:hi], own.vec[lo:hi])
    assert held.apply_refresh(*parsed[0]) is False  # a late copy changes nothing


def test_a_copy_never_goes_back_in_version() -> None:
    """A refresh older than the copy is ignored (a late packet); a sender that
    restarted has a new wire epoch and the exchange gives it a fresh copy."""
    layout = Layout.for_payload(1000, 0.1, 256)
    own = OwnEstimate(torch.zeros(1000), layout, history=4)
    held = HeldEstimate(layout)
    _repair(own, held)
    for rnd in range(3):
        _deliver(held, _send(own, torch.randn(1000), rnd))
    before = held.vec.clone()
    restarted = OwnEstimate(torch.ones(1000), layout, history=4)  # versions back to 0
    assert _repair(restarted, held) == {"refresh"}
    assert torch.equal(held.vec, before)


def _good_delta(layout: Layout) -> tuple[dict, bytes]:
    own = OwnEstimate(torch.zeros(layout.numel), layout, history=1)
    return _send(own, torch.randn(layout.numel, generator=torch.Generator().manual_seed(0)), 0)[0]


def test_forged_or_malformed_packets_parse_to_none() -> None:
    layout = Layout.for_payload(2000, 0.1, 256)
    fields, payload = _good_delta(layout)
    assert codec.parse_delta(fields, payload, layout) is not None
    n = fields["n"]
    bad_fields = [
        {**fields, "b": layout.nblocks},  # block out of range
        {**fields, "b": -1},
        {**fields, "b": "0"},  # wrong type
        {**fields, "u": -1},
        {**fields, "n": n + 1},  # count disagrees with the payload
        {**fields, "n": 0},
        {k: v for k, v in fields.items() if k != "u"},  # missing version
        {**fields, "b": True},  # bool is not an int here
    ]
    for f in bad_fields:
        assert codec.parse_delta(f, payload, layout) is None, f
    offs_at = 4
    far = bytearray(payload)
    far[offs_at : offs_at + 2] = (65535).to_bytes(2, "little")  # offset past the block
    nan = bytearray(payload)
    nan[0:4] = np.float32(np.nan).tobytes()
    neg = bytearray(payload)
    neg[0:4] = np.float32(-1.0).tobytes()
    for p in (bytes(far), bytes(nan), bytes(neg), payload[:-1], payload + b"\0", b""):
        assert codec.parse_delta(fields, p, layout) is None
    # refresh: misaligned, overlong, non-finite
    good = {"b": 0, "u": 0, "o": 0, "n": layout.segment}
    vals = np.zeros(layout.segment, "<f4").tobytes()
    assert codec.parse_refresh(good, vals, layout) is not None
    assert codec.parse_refresh({**good, "o": 1}, vals, layout) is None
    assert codec.parse_refresh({**good, "n": layout.segment + 1}, vals + b"\0" * 4, layout) is None
    assert (
        codec.parse_refresh(good, np.full(layout.segment, np.inf, "<f4").tobytes(), layout) is None
    )
    assert codec.parse_refresh({**good, "o": layout.block}, vals, layout) is None
    # END: another vector's layout, a short version list; NACK: blocks out of range
    end = {"r": 3, "t": 1, "h": 2, "d": layout.numel}
    versions = codec.end_payload(np.zeros(layout.nblocks, np.int64))
    assert codec.parse_end(end, versions, layout) is not None
    assert codec.parse_end({**end, "d": layout.numel + 1}, versions, layout) is None
    assert codec.parse_end(end, versions[:-4], layout) is None
    assert codec.parse_end({**end, "t": 2}, versions, layout) is None
    assert codec.parse_end({**end, "h": -3}, versions, layout) is None
    assert codec.parse_end({**end, "r": -2}, versions, layout) is None
    assert codec.parse_end({k: v for k, v in end.items() if k != "h"}, versions, layout) is None
    assert codec.parse_nack(codec.nack_payload(np.array([0]), np.array([-1])), layout) == [(0, -1)]
    assert (
        codec.parse_nack(codec.nack_payload(np.array([layout.nblocks]), np.array([0])), layout)
        is None
    )
    assert codec.parse_nack(codec.nack_payload(np.array([0]), np.array([-2])), layout) is None
    assert codec.parse_nack(b"\0" * 7, layout) is None
    assert codec.parse_nack(b"", layout) is None
