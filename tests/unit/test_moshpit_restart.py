"""Kill and restart during Moshpit averaging: back in a group within 3 rounds.

16 nodes on a 4x4 grid, MemoryNetwork, FakeClock.  After every round each
peer publishes its values as its state (what the optimizer strategy does
when asked).  One peer is killed without a goodbye, the others go on, then
it restarts under the same id (a newer epoch), downloads the state of a live
peer, finds the current round from the others' beacons on its own, and
must be averaging inside a group, with values equal to its group's, within
three rounds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gossipnet import Config, FakeClock
from gossipnet.averaging.moshpit import MoshpitAverager, MoshpitConfig
from gossipnet.averaging.statesync import StateSync, pack_state, unpack_state

N = 16
VICTIM = 5
NET = {
    "heartbeat_interval_s": 0.2,
    "failure_timeout_s": 1.0,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "collective_timeout_s": 2.0,
}
MOSH = MoshpitConfig(grid=(4, 2), matchmaking_timeout_s=0.3, join_min_wait_s=0.05)


@pytest.mark.timeout(60)
def test_restarted_peer_is_back_in_a_group_within_three_rounds(
    run_async: Callable[..., Any],
    cluster: Any,
    drive: Any,
    start_node: Any,
    wait_until: Any,
) -> None:
    cfg = Config(**NET, chunk_bytes=1024)

    async def main() -> None:
        clock = FakeClock()
        async with cluster(N, config=cfg, clock=clock) as nodes:
            network = nodes[0].transport.network  # type: ignore[union-attr]
            avs = [MoshpitAverager(nd, MOSH) for nd in nodes]
            ss = [StateSync(nd) for nd in nodes]
            gen = torch.Generator().manual_seed(3)
            xs = [torch.randn(512, generator=gen, dtype=torch.float64) for _ in range(N)]
            live = set(range(N))

            async def round_(t: int | None, who: set[int]) -> dict[int, Any]:
                idx = sorted(who)
                runs = [avs[i].average([xs[i]], rounds=1, start_round=t) for i in idx]
                reps = await drive(clock, asyncio.gather(*runs), timeout_s=20)
                for i in idx:
                    ss[i].publish(pack_state({"x": xs[i]}), {"round": reps[0].round})
                return dict(zip(idx, reps, strict=True))

            for t in range(3):
                await round_(t, live)
            await nodes[VICTIM].close(announce=False)  # SIGKILL: no LEAVE
            live.discard(VICTIM)
            for t in range(3, 5):
                await round_(t, live)

            # restart: same id, new epoch, fresh (wrong) values, nothing else kept
            addresses = [f"mem://p{i}" for i in range(N)]
            node = await start_node(
                network, f"p{VICTIM}", config=cfg, clock=clock, bootstrap=addresses
            )
            nodes[VICTIM] = node
            avs[VICTIM] = MoshpitAverager(node, MOSH)
            ss[VICTIM] = StateSync(node)
            xs[VICTIM] = torch.full((512,), 1e6, dtype=torch.float64)
            await wait_until(
                lambda: (
                    len(node.alive_peers()) == N
                    and all(nodes[i].membership.is_alive(f"p{VICTIM}") for i in live)
                ),  # type: ignore[union-attr]
                5,
                clock=clock,
                what="restarted peer seen by all",
            )
            data, rep = await drive(clock, ss[VICTIM].download(timeout_s=5))
            assert data is not None, rep
            assert rep.ok
            xs[VICTIM] = unpack_state(data)["x"].clone()
            src = int(rep.source[1:])  # type: ignore[index]
            assert torch.equal(xs[VICTIM], xs[src])  # nobody averaged since it was published
            # it learns where the others are from their heartbeat beacons
            await wait_until(lambda: avs[VICTIM].max_seen >= 5, 1, clock=clock, what="beacon")

            live.add(VICTIM)
            back = None
            for t in range(5, 8):
                runs = [
                    avs[i].average([xs[i]], rounds=1, start_round=None if i == VICTIM else t)
                    for i in sorted(live)  # the restarted peer finds round t by itself
                ]
                reps = dict(
                    zip(sorted(live), await drive(clock, asyncio.gather(*runs)), strict=True)
                )
                mine = reps[VICTIM]
                assert mine.round == t
                if len(mine.participants) >= 2:
                    back = t
                    for p in mine.participants:
                        assert torch.equal(xs[int(p[1:])], xs[VICTIM])
                    break
            assert back is not None
            assert back - 5 < 3

    run_async(main())
