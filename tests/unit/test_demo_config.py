"""DemoConfig: the late-loss option (loss-free steps first) and how the text is split."""

from __future__ import annotations

import pytest
import torch

from gossipnet.demo.harness import DemoConfig, LateLoss, shard_stream


def test_late_loss_is_off_until_switched_on() -> None:
    cfg = DemoConfig(loss=0.1, loss_from=200, steps=300)
    late = LateLoss(cfg.loss)
    plan = cfg.fault_plan(late)
    assert plan is not None
    assert plan.link_loss is late
    assert plan.link_loss("a", "b", 0.0) == 0.0
    late.on = True
    assert plan.link_loss("a", "b", 0.0) == 0.1
    assert "from step 200" in cfg.label()
    # without the switch (or without loss_from) the plan is the plain Bernoulli one
    assert DemoConfig(loss=0.1).fault_plan() == DemoConfig(loss=0.1).fault_plan(None)
    assert DemoConfig(loss=0.0, loss_from=5).fault_plan(late) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss": 0.1, "loss_from": 300, "steps": 300},
        {"loss": 0.1, "loss_from": -1},
        {"loss": 0.1, "loss_from": 10, "burst": 8.0},
    ],
    ids=["past-the-end", "negative", "bursty"],
)
def test_bad_late_loss_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="loss_from"):
        DemoConfig(**kwargs)  # type: ignore[arg-type]


def test_shuffled_split_deals_disjoint_blocks_that_cover_the_stream() -> None:
    # what DistributedSampler does: every peer's share mixes the whole corpus, so
    # their gradients share one expectation (the all-reduce's unbiasedness condition)
    stream = torch.arange(10 * 64)
    cfg = DemoConfig(peers=3, data_seed=5)
    shares = [shard_stream(stream, r, cfg, block=64) for r in range(3)]
    blocks = [set((s.view(-1, 64)[:, 0] // 64).tolist()) for s in shares]
    assert [len(b) for b in blocks] == [4, 3, 3]
    assert set().union(*blocks) == set(range(10))
    assert sum(len(b) for b in blocks) == 10  # disjoint
    for s in shares:  # each block intact and kept in stream order
        rows = s.view(-1, 64)
        assert torch.equal(rows - rows[:, :1], torch.arange(64).expand_as(rows))
        assert torch.all(rows[1:, 0] > rows[:-1, 0])
    # not one contiguous run of the stream per peer, and the same for the same seed
    assert any(max(b) - min(b) + 1 > len(b) for b in blocks)
    again = shard_stream(stream, 1, DemoConfig(peers=3, data_seed=5), block=64)
    assert torch.equal(again, shares[1])
    other = shard_stream(stream, 1, DemoConfig(peers=3, data_seed=6), block=64)
    assert not torch.equal(other, shares[1])


def test_contiguous_split_is_one_slice_per_peer() -> None:
    stream = torch.arange(100)
    cfg = DemoConfig(peers=4, split="contiguous")
    assert torch.equal(shard_stream(stream, 2, cfg), torch.arange(50, 75))
    with pytest.raises(ValueError, match="split"):
        DemoConfig(split="random")


def test_demo_command_line_reaches_the_demo_config() -> None:
    """``gossipnet demo`` options land in DemoConfig (hence in the peers' Config)."""
    import argparse

    from gossipnet import cli

    parser = argparse.ArgumentParser()
    cli._configure_demo(parser)
    default = cli._demo_config(parser.parse_args([]))
    assert default.stale_step
    assert default.parity_group is None  # the library decides: parity in optimizer rounds
    cfg = cli._demo_config(parser.parse_args(["--no-stale-step", "--parity", "3"]))
    assert not cfg.stale_step
    assert cfg.parity_group == 3
