"""Vehicles that train one model together over a lossy radio, choosing whom to talk to by route.

Run it (about 20 s on a laptop; nothing is downloaded):

    .venv/bin/python examples/vehicles.py            # writes runs/vehicles.png

What happens:
1. 16 vehicles drive random trips through a 3x3-block grid city (300 m square).
   Each one announces its route: timed waypoints.
2. Every round, each vehicle trains a small classifier on its own data for 2 s,
   then the fleet has 20 s of radio time to exchange models (4 MB each, so one
   exchange takes 3-20 s depending on distance; beyond 150 m nothing gets through).
3. Route-aware gossip (gossipnet.mobility) predicts from the routes which pairs
   will stay in range long enough, splits them into matchings (a radio talks to
   one peer at a time) and picks the phases that best connect the fleet
   (largest algebraic connectivity per second of radio time).
4. The same fleet runs again with SGP (push-sum over a fixed exponential graph,
   which ignores where vehicles are) and with a scheduler that knows only today's
   distances, not the routes.  The plot shows accuracy over simulated time and a
   snapshot of the links route-aware gossip chose in one round.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from gossipnet.mobility import CityGrid, Fleet, SimConfig, link_table, plan_schedule, simulate

OUT = Path("runs/vehicles.png")
TARGET = 0.75  # mean test accuracy over the vehicles


def main() -> None:
    config = SimConfig(vehicles=16, city=CityGrid(blocks_x=3, blocks_y=3), rounds=100)
    fleet = Fleet(config)  # routes, data and the initial model, shared by every run

    traces = {}
    for strategy in ("route", "loss_aware", "sgp"):
        traces[strategy] = tr = simulate(config, strategy, Fleet(config))
        reached = tr.seconds_to(TARGET)
        when = f"after {reached / 60:4.1f} min" if np.isfinite(reached) else "not reached"
        print(
            f"{strategy:11s} accuracy {tr.accuracy[-1]:.3f} after {tr.time_s[-1] / 60:5.1f} "
            f"simulated min; {TARGET} {when}; exchanges that got through: "
            f"{tr.delivered.sum()}/{tr.tried.sum()}"
        )

    # One round's plan, as every vehicle computes it from the shared routes.
    t0 = 300.0
    grid = t0 + config.dt_s * np.arange(int(config.schedule.budget_s / config.dt_s) + 1)
    predicted = fleet.predicted_positions(t0, grid)
    table = link_table(predicted, config.radio, 2 * config.model_bytes, config.dt_s)
    schedule = plan_schedule(table, config.schedule)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    city = config.city
    width, height = city.blocks_x * city.block_m, city.blocks_y * city.block_m
    for k in range(city.blocks_y + 1):  # the streets
        left.plot([0, width], [k * city.block_m] * 2, color="0.85", lw=6, zorder=0)
    for k in range(city.blocks_x + 1):
        left.plot([k * city.block_m] * 2, [0, height], color="0.85", lw=6, zorder=0)
    left.plot(predicted[:, :, 0].T, predicted[:, :, 1].T, color="0.6", lw=0.8)  # next 20 s
    left.scatter(predicted[:, 0, 0], predicted[:, 0, 1], color="k", zorder=3, s=20)
    for p, phase in enumerate(schedule.phases):  # one colour per phase (a matching)
        for k, (i, j) in enumerate(phase.edges):
            xy = predicted[[i, j], 0]
            label = f"phase {p + 1}: {phase.duration_s:.0f} s" if k == 0 else None
            left.plot(xy[:, 0], xy[:, 1], color=f"C{p}", lw=2.5, label=label)
    left.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    left.set(title=f"links chosen at t = {t0:.0f} s (grey: next 20 s)", aspect="equal")

    for strategy, tr in traces.items():
        right.plot(tr.time_s / 60, tr.accuracy, label=strategy)
    right.axhline(TARGET, color="0.5", ls=":")
    right.set(xlabel="simulated minutes", ylabel="mean test accuracy", title="training")
    right.set_xlim(0, traces["route"].time_s[-1] / 60)
    right.legend()
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"plot: {OUT}")


if __name__ == "__main__":
    main()
