"""A Moshpit joiner checks the state it downloads against its own model.

Moshpit replicas differ by design, so there is no digest for members to vote on
when a peer joins: what it downloads is checked instead (size bounded by the
local layout, shapes, dtypes, finite values) and the donor's hyperparameters are
never taken.  Both passed on the old code: a donor's lr of 1e6 was adopted, and a
state of another shape raised out of the optimizer's construction.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import gossipnet
from gossipnet.testing import run_peers


def _join(donor_model: torch.nn.Module, donor_lr: float) -> Any:
    published = threading.Event()

    def body(rank: int, net: gossipnet.Peer) -> Any:
        if rank == 0:
            opt = net.optimizer(
                torch.optim.SGD(donor_model.parameters(), lr=donor_lr),
                strategy="moshpit", sync_state=False,
            )  # fmt: skip
            published.set()
            return None
        assert published.wait(20)
        model = torch.nn.Linear(4, 1)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1.0)
        opt = net.optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy="moshpit")
        lr = opt.param_groups[0]["lr"] if hasattr(opt, "param_groups") else None
        return lr, [p.detach().clone() for p in model.parameters()], opt

    return run_peers(2, body, timeout_s=50)[1]


@pytest.mark.timeout(60)
def test_a_joiner_takes_the_donors_parameters_but_never_its_learning_rate() -> None:
    donor = torch.nn.Linear(4, 1)
    with torch.no_grad():
        for p in donor.parameters():
            p.fill_(7.0)
    lr, params, _ = _join(donor, donor_lr=1e6)
    assert lr == 0.1
    assert all(torch.equal(p, torch.full_like(p, 7.0)) for p in params)


@pytest.mark.timeout(60)
def test_a_state_of_another_shape_is_refused_and_counted_not_raised() -> None:
    lr, params, opt = _join(torch.nn.Linear(8, 2), donor_lr=0.1)
    assert lr == 0.1
    assert all(torch.equal(p, torch.ones_like(p)) for p in params)  # kept our own
    strategy = getattr(opt, "_strategy", None) or getattr(opt, "strategy", None)
    rejected = getattr(strategy, "state_rejected", None)
    assert rejected is not None
    assert sum(rejected.values()) == 1, rejected
