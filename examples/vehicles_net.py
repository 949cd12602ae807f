"""Vehicles as real gossipnet peers: `strategy="route"` over a lossy radio, in one process.

Run it (about 20 s, mostly waiting out exchanges the radio loses; nothing downloaded):

    .venv/bin/python examples/vehicles_net.py

examples/vehicles.py simulates a fleet; here each vehicle is a joined peer with its
own event-loop thread, talking over an in-process network whose per-link loss comes
from the radio model at the vehicles' distance (`gossipnet.testing.radio_faults`).
Each vehicle:
1. joins with its route (timed waypoints on a 2x2-block grid city) and the radio
   model; the peers share their routes over the network;
2. trains a small linear model on its own data, with
   `net.optimizer(..., strategy="route", average_every=2)`: local SGD steps, and
   every 2 steps one gossip round on the matchings that the routes predict will
   connect the fleet best (every peer computes the same plan on its own);
3. prints, per averaging round, its loss and which neighbours' models arrived.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

import gossipnet
from gossipnet.mobility import ScheduleConfig
from gossipnet.testing import MemoryNetwork, radio_faults

VEHICLES, STEPS, EVERY = 5, 24, 2
RADIO = gossipnet.RadioModel()
SCHEDULE = ScheduleConfig(budget_s=0.5)  # radio time per gossip round
ROUND_S = 2.0  # round r plans the fleet's links from route time ROUND_S * r
TRUE_W = torch.tensor([[1.5, -2.0, 0.5, 1.0]])
NOW_S = [0.0]  # the route time of the round in progress: where the emulated radio is


def routes() -> list[gossipnet.Route]:
    """Two cars cross the city (100 m blocks) at 10 m/s, three are parked."""
    t = np.array([0.0, 20.0])
    return [
        gossipnet.Route(t, np.array([[0.0, 100.0], [200.0, 100.0]])),
        gossipnet.Route(t, np.array([[100.0, 200.0], [100.0, 0.0]])),
        gossipnet.Route(np.array([0.0]), np.array([[100.0, 100.0]])),
        gossipnet.Route(np.array([0.0]), np.array([[50.0, 0.0]])),
        gossipnet.Route(np.array([0.0]), np.array([[150.0, 200.0]])),
    ]


def vehicle(rank: int, net: gossipnet.Peer, log: list[str], done: threading.Barrier) -> None:
    torch.manual_seed(0)  # every vehicle starts from the same model
    model = torch.nn.Linear(4, 1)
    opt = net.optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), strategy="route", average_every=EVERY
    )
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(128, 4, generator=gen) + 0.3 * rank  # each vehicle sees other data
    y = x @ TRUE_W.T + 0.1 * torch.randn(128, 1, generator=gen)
    for step in range(STEPS):
        NOW_S[0] = ROUND_S * (step // EVERY)  # every vehicle writes the same value
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        rep = opt.step()
        if rep.method == "route":
            heard = ",".join(p for p in rep.contributors if p != net.peer_id) or "nobody"
            lost = f"{rep.packets_lost}/{rep.packets_lost + rep.packets_received}"
            log.append(
                f"step {step + 1:2d}  {net.peer_id}  loss {loss.item():7.3f}  "
                f"models from: {heard:9s} packets lost {lost}"
            )
    log.append(f"final {net.peer_id} weights {model.weight.detach().numpy().round(2)}")
    done.wait()  # leave only once every vehicle is done (no round is cut short)


def main() -> None:
    network, route = MemoryNetwork(), routes()
    addresses = [f"mem://v{i}" for i in range(VEHICLES)]
    # Loss per packet from the radio model at the two vehicles' distance, at the route
    # time of the round in progress (a real radio would need no such help).
    table = dict(zip(addresses, route, strict=True))
    faults = radio_faults(table, RADIO, route_time=lambda t: NOW_S[0], seed=7)
    log: list[str] = []
    done = threading.Barrier(VEHICLES, timeout=120)

    def run(i: int) -> None:
        with gossipnet.join(
            addresses,
            listen=addresses[i],
            network=network,
            secret=b"fleet",
            peer_id=f"v{i}",
            faults=faults,
            route=route[i],
            radio=RADIO,
            handle_sigterm=False,
            join_timeout_s=1.0,  # vehicles out of range are not waited for:
            min_peers=1,  # a vehicle may start alone and meet the others on the road
            control_timeout_s=0.5,  # bounds the receipt wait of a link that died
        ) as net:
            net.set_route(schedule=SCHEDULE, route_time=lambda r: ROUND_S * r)
            vehicle(i, net, log, done)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(VEHICLES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("\n".join(sorted(log, key=lambda line: (line.startswith("final"), line))))


if __name__ == "__main__":
    main()
