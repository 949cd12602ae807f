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
from gossipnet.collectives.moshpit.averager import MoshpitAverager, MoshpitConfig
from gossipnet.collectives.statesync.sync import StateSync, pack_state, unpack_state

N = 16
VICTIM = 5
NET = {
    "heartbeat_interval_s": 0.2,
    "failure_timeout_s": 1.0,
    "control_retry_s": 0.02,
    "control_timeout_s": 1.0,
    "collective_timeout_s": 2.0,
}
MOSH = MoshpitConfig(
    grid=(4, 2), matchmaking_timeout_s=0.3, join_min_wait_s=0.05, ack_timeout_s=0.05
)


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

            async def sweep(who: set[int]) -> dict[int, Any]:
                """One call (a sweep of d = 2 rounds) on the peers in ``who``."""
                idx = sorted(who)
                runs = [avs[i].average([xs[i]]) for i in idx]
                reps = await drive(clock, asyncio.gather(*runs), timeout_s=20)
                for i in idx:  # what the optimizer strategy does when a joiner asks
                    ss[i].publish(pack_state({"x": xs[i]}), {"round": reps[0].round})
                return dict(zip(idx, reps, strict=True))

            for _ in range(3):
                await sweep(live)
            await nodes[VICTIM].close(announce=False)  # SIGKILL: no LEAVE
            live.discard(VICTIM)
            for _ in range(2):
                await sweep(live)
            now_at = avs[0].next_round  # the others are about to start this round

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
            await wait_until(lambda: avs[VICTIM].max_seen >= now_at, 1, clock=clock, what="beacon")

            live.add(VICTIM)
            reps = await sweep(live)  # the restarted peer finds the round by itself
            rounds = avs[VICTIM].last_rounds
            reps = await sweep(live)
            rounds = rounds + avs[VICTIM].last_rounds
            assert rounds[0].round == now_at
            # (next() with a default: a StopIteration must not escape a coroutine)
            back = next((k for k, r in enumerate(rounds) if len(r.participants) >= 2), None)
            assert back is not None, rounds
            assert back < 3
            # after its last round it holds exactly its last group's values
            last = rounds[-1]
            for p in last.participants:
                assert torch.equal(xs[int(p[1:])], xs[VICTIM])
            assert reps[VICTIM].extra["alone_rounds"] == 0

    run_async(main())
