"""``torch.distributed`` backend ``"gossipnet"``: unchanged DDP scripts over gossipnet.

``import gossipnet`` calls :func:`register`, after which::

    dist.init_process_group("gossipnet")        # torchrun's environment, as for gloo
    model = DistributedDataParallel(model)      # gradients go through the lossy all-reduce

Why registration is all this package does at import: ``torch.distributed`` is already
imported with ``torch``, so registering a name and a creator function costs a dict
entry; the process group, its rendezvous and the peer it starts are imported only
when ``init_process_group("gossipnet")`` calls the creator.

Why a package of its own above the facade: the backend is a *user* of ``join()`` and
``Peer`` like any script, plus the reliable exchange of its exact collectives
(:mod:`.exchange`); ``gossipnet/__init__`` imports only this module (the one edge
from the facade up, allowed by name in ``tests/unit/test_layers.py``).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from gossipnet.distributed.options import GossipnetOptions
    from gossipnet.distributed.process_group import ProcessGroupGossipnet
    from gossipnet.reports import CollectiveReport

__all__ = (
    "BACKEND",
    "GossipnetOptions",
    "ProcessGroupGossipnet",
    "last_report",
    "register",
    "totals",
)

#: The name to pass to ``init_process_group``.
BACKEND = "gossipnet"


def register() -> None:
    """Register the backend with ``torch.distributed`` (idempotent, cheap)."""
    if not dist.is_available() or BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def _create(backend_opts: Any, pg_options: Any) -> ProcessGroupGossipnet:
    """torch's creator hook: start this rank's peer and wrap it in a process group."""
    from gossipnet.distributed.options import resolve_options
    from gossipnet.distributed.process_group import ProcessGroupGossipnet
    from gossipnet.distributed.rendezvous import start_peer

    rank, world = backend_opts.group_rank, backend_opts.group_size
    timeout = backend_opts.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(minutes=30)
    options = resolve_options(pg_options, rank)
    peer, exchange = start_peer(
        backend_opts.store, rank, world, options, group=str(backend_opts.group_id), timeout=timeout
    )
    return ProcessGroupGossipnet(peer, exchange, rank, world, options, timeout.total_seconds())


def _gossip_group(group: Any) -> ProcessGroupGossipnet:
    from gossipnet.distributed.process_group import ProcessGroupGossipnet

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupGossipnet):
        raise TypeError(f"{pg!r} is not a gossipnet process group")
    return pg


def last_report(group: Any = None) -> CollectiveReport | None:
    """The newest lossy all-reduce's report of ``group`` (default: the default group)."""
    return _gossip_group(group).last_report


def totals(group: Any = None) -> dict[str, int]:
    """Counts since the group started: calls, lossy rounds, packets and chunks lost, and
    the exact collectives' parts (``exact_parts_in``, ``exact_parts_out``, and those
    refused by reason: ``exact_dropped_not_member``, ``exact_dropped_ahead``, ...)."""
    pg = _gossip_group(group)
    return dict(pg.totals) | {f"exact_{k}": v for k, v in pg.exchange_counters().items()}


def __getattr__(name: str) -> Any:
    """The classes, imported on first use (not at ``import gossipnet``)."""
    found: Any
    if name == "GossipnetOptions":
        from gossipnet.distributed.options import GossipnetOptions

        found = GossipnetOptions
    elif name == "ProcessGroupGossipnet":
        from gossipnet.distributed.process_group import ProcessGroupGossipnet

        found = ProcessGroupGossipnet
    else:
        raise AttributeError(name)
    globals()[name] = found  # once: later lookups (and pdoc) find it in the module
    return found
