"""The torch backend's settings and tensor rules, without a network.

Why: a typo in an environment variable must be an error naming it, never a run with
other settings; and the SUM scaling and byte checks are what the collectives' exactness
hangs on.
"""

from __future__ import annotations

import pytest
import torch

from gossipnet import ConfigError, FaultPlan
from gossipnet.distributed.options import GossipnetOptions, resolve_options
from gossipnet.distributed.tensors import (
    UnsupportedError,
    check_op,
    exact_reduce,
    from_bytes,
    stage,
    to_bytes,
)


def test_environment_fills_what_pg_options_leave_open() -> None:
    env = {
        "GOSSIPNET_SECRET": "s3",
        "GOSSIPNET_TRANSPORT": "udp",
        "GOSSIPNET_LOSS": "0.1",
        "GOSSIPNET_FAULTS": '{"seed": 4, "duplicate": 0.01}',
        "GOSSIPNET_CONFIG": '{"collective_timeout_s": 7}',
        "GOSSIPNET_EXACT_MAX_BYTES": "0",
        "GOSSIPNET_REPAIR": "0",
    }
    o = resolve_options(None, rank=2, env=env)
    assert (o.secret, o.transport, o.exact_max_bytes, o.repair) == ("s3", "udp", 0, False)
    assert o.config is not None
    assert o.config.collective_timeout_s == 7
    assert o.faults is not None
    assert (o.faults.loss, o.faults.duplicate) == (0.1, 0.01)
    assert o.faults.seed == 4 + 2 * 7919  # ranks lose different packets
    given = GossipnetOptions(transport="tcp", faults=FaultPlan(loss=0.2), repair=True)
    o = resolve_options(given, rank=0, env=env)
    assert (o.transport, o.faults.loss if o.faults else None, o.repair) == ("tcp", 0.2, True)
    o = resolve_options(None, rank=0, env={})
    assert (o.transport, o.faults, o.exact_max_bytes, o.repair) == ("tcp", None, 4096, True)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"GOSSIPNET_LOSS": "ten"}, "GOSSIPNET_LOSS"),
        ({"GOSSIPNET_LOSS": "1.5"}, "GOSSIPNET_LOSS"),
        ({"GOSSIPNET_TRANSPORT": "quic"}, "GOSSIPNET_TRANSPORT"),
        ({"GOSSIPNET_CONFIG": '{"colective_timeout_s": 1}'}, "GOSSIPNET_CONFIG"),
        ({"GOSSIPNET_CONFIG": "[1]"}, "GOSSIPNET_CONFIG"),
        ({"GOSSIPNET_FAULTS": "{bad json"}, "GOSSIPNET_FAULTS"),
        ({"GOSSIPNET_EXACT_MAX_BYTES": "-1"}, "GOSSIPNET_EXACT_MAX_BYTES"),
        ({"GOSSIPNET_REPAIR": "yes"}, "GOSSIPNET_REPAIR"),
    ],
)
def test_a_bad_variable_is_an_error_naming_it(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        resolve_options(None, rank=0, env=env)


def test_pg_options_of_another_type_is_an_error() -> None:
    with pytest.raises(ConfigError, match="GossipnetOptions"):
        resolve_options({"secret": "x"}, rank=0, env={})


def test_exact_sum_scales_to_the_world_when_a_rank_is_missing() -> None:
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert exact_reduce("SUM", rows, world=2).tolist() == [4.0, 6.0]
    assert exact_reduce("SUM", rows, world=4).tolist() == [8.0, 12.0]  # 4 x mean of 2
    ints = torch.tensor([[1, 6], [3, 5]])
    assert exact_reduce("SUM", ints, world=3).tolist() == [4, 11]  # integers: plain sums
    assert exact_reduce("BXOR", ints, world=2).tolist() == [2, 3]
    assert exact_reduce("AVG", rows, world=2).tolist() == [2.0, 3.0]


def test_ops_the_backend_cannot_do_are_named() -> None:
    with pytest.raises(UnsupportedError, match="PREMUL_SUM is not supported"):
        check_op("PREMUL_SUM", torch.float32)
    with pytest.raises(UnsupportedError, match="AVG needs float"):
        check_op("AVG", torch.int64)
    check_op("MAX", torch.int64)


def test_bytes_round_trip_and_a_wrong_length_is_an_error() -> None:
    like = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.int32)]
    sent = [
        torch.tensor([1.5, -2.0, 3.0], dtype=torch.float64),
        torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
    ]
    back = from_bytes(to_bytes(sent), like)
    assert all(torch.equal(a, b) for a, b in zip(back, sent, strict=True))
    with pytest.raises(ValueError, match="different shapes or dtypes"):
        from_bytes(to_bytes(sent)[:-1], like)


def test_non_finite_input_is_zeroed_and_weighted_zero() -> None:
    t = torch.tensor([1.0, float("nan"), float("inf")])
    staged = stage([t])
    assert staged.weight == 0.0
    assert t.tolist() == [1.0, 0.0, 0.0]  # zeroed in place
    assert stage([torch.ones(2)]).weight == 1.0
