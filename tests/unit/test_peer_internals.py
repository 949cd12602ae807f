"""Pure helpers under ``Peer``: join()'s resolution of its arguments, and staging.

``resolve_join`` is pure (no sockets), so torchrun's rules are checked here on
the function itself; ``stage`` is checked on what it does to tensors.  Which
module holds which name is not pinned (that is the code's to change); the
public surface is pinned in ``test_public_api.py``.
"""

from __future__ import annotations

import pytest
import torch

from gossipnet import _collective
from gossipnet.config import Config
from gossipnet.errors import ConfigError
from gossipnet.runtime import join as _join
from gossipnet.runtime.flatbuffer import FlatCache


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GOSSIPNET_SECRET"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_resolve_join_reads_torchrun_only_without_peers(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "2")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("MASTER_ADDR", "localhost")
    clean_env.setenv("MASTER_PORT", "1000")
    plan = _join.resolve_join(None, None, secret=None, config=None, wait_for=None, overrides={})
    assert plan.bootstrap == ["tcp://127.0.0.1:1001"]
    assert plan.listen == "tcp://0.0.0.0:0"
    assert plan.peer_id == "rank2"
    assert plan.expected_peers == 4
    explicit = _join.resolve_join(
        ["mem://a"], None, secret="s", config=None, wait_for=None, overrides={"peer_id": "me"}
    )
    assert (explicit.bootstrap, explicit.listen, explicit.peer_id) == (["mem://a"], "mem://", "me")
    assert explicit.secret == b"s"
    assert explicit.expected_peers is None


def test_resolve_join_secret_from_env_and_bad_torchrun(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("GOSSIPNET_SECRET", "k")
    plan = _join.resolve_join([], None, secret=None, config=Config(), wait_for=3, overrides={})
    assert (plan.secret, plan.listen, plan.expected_peers) == (b"k", "tcp://127.0.0.1:0", 3)
    clean_env.setenv("RANK", "x")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="not integers"):
        _join.resolve_join(None, None, secret=None, config=None, wait_for=None, overrides={})


def test_stage_zeroes_nonfinite_and_writes_back() -> None:
    tensors = [
        torch.tensor([1.0, float("nan")]),
        torch.tensor([[float("inf")]], dtype=torch.float64),
    ]
    cache = FlatCache()
    flat = cache.get(tensors)
    assert cache.get(tensors) is flat
    staged = _collective.stage(flat, tensors)
    assert staged.nonfinite
    for c in staged.cpu:
        c.fill_(3.0)
    staged.write_back(tensors)
    assert tensors[0].tolist() == [3.0, 3.0]
    assert tensors[1].tolist() == [[3.0]]


def test_cached_buffer_never_writes_into_another_calls_tensors() -> None:
    """A buffer that borrowed ``a``'s memory (zero-copy) is not reused for ``b`` of the
    same layout: flattening ``b`` into it overwrote ``a`` (found by the #22 work)."""
    cache = FlatCache()
    a, b = torch.full((1000,), 1.0), torch.full((1000,), 10.0)
    flat_a = cache.get([a])
    assert flat_a.borrowed
    assert flat_a.buckets[0].data_ptr() == a.data_ptr()  # zero-copy for the same tensors
    flat_b = cache.get([b])
    flat_b.flatten([b])
    assert torch.equal(a, torch.full((1000,), 1.0))
    assert cache.get([b]) is flat_b  # the loop that reduces b every step keeps its buffer
    strided = torch.full((2000,), 5.0)[::2]  # not contiguous: a bucket of its own
    flat_s = cache.get([strided])
    flat_s.flatten([strided])
    assert not flat_s.borrowed
    assert torch.equal(b, torch.full((1000,), 10.0))
    owned = cache.get([strided])
    assert owned is flat_s  # an allocated bucket is safe to reuse for any tensors
    assert cache.get([torch.zeros(2000)[::2]]) is flat_s
