"""Route-aware topology for mobile peers (RoADTrain, reconstructed): who talks to whom.

Vehicles that train together lose most exchanges to distance and short contacts.
This package turns shared routes into a gossip topology (DESIGN.md section 4;
ALGORITHMS.md section 4 is a reconstruction, the paper was not available):

- :mod:`.routes`: a grid city, timed-waypoint routes, exact contact windows.
- :mod:`.radio`: delivery, bandwidth and outage vs distance; per-pair exchange
  times and success probabilities (:func:`link_table`).
- :mod:`.topology`: Laplacians, Fiedler values, Misra-Gries matchings.
- :mod:`.schedule`: the phases (matchings, with start times) that maximise expected
  algebraic connectivity within a round's time budget.
- :mod:`.mixing`: Metropolis-Hastings, symmetric drops, push-sum, SGP's graph.
- :mod:`.gossip`: the training-peer side (``strategy="route"``): plan, weights, and a
  round over a node with chunk receipts.
- :mod:`.simulate`: vehicles driving and training a small model, against SGP, random
  gossip, all-neighbours and a loss-aware scheduler that ignores routes.

Nothing here imports the transport: a peer hands :class:`RouteGossip` its node.
"""

from __future__ import annotations

from gossipnet.mobility.gossip import (
    RouteGossip,
    partner_of,
    peer_mixing_row,
    plan_round,
    radio_link_faults,
    round_mixing_matrix,
)
from gossipnet.mobility.mixing import (
    consensus_error,
    metropolis_weights,
    mix_matching,
    push_sum_step,
    sgp_out_peers,
)
from gossipnet.mobility.radio import LinkTable, RadioModel, exchange_probability, link_table
from gossipnet.mobility.routes import CityGrid, Itinerary, Route, TrafficConfig, contact_windows
from gossipnet.mobility.schedule import Phase, Schedule, ScheduleConfig, plan_schedule
from gossipnet.mobility.simulate import STRATEGIES, Fleet, SimConfig, Trace, simulate
from gossipnet.mobility.topology import edge_colouring, fiedler_value, laplacian

__all__ = (
    "STRATEGIES",
    "CityGrid",
    "Fleet",
    "Itinerary",
    "LinkTable",
    "Phase",
    "RadioModel",
    "Route",
    "RouteGossip",
    "Schedule",
    "ScheduleConfig",
    "SimConfig",
    "Trace",
    "TrafficConfig",
    "consensus_error",
    "contact_windows",
    "edge_colouring",
    "exchange_probability",
    "fiedler_value",
    "laplacian",
    "link_table",
    "metropolis_weights",
    "mix_matching",
    "partner_of",
    "peer_mixing_row",
    "plan_round",
    "plan_schedule",
    "push_sum_step",
    "radio_link_faults",
    "round_mixing_matrix",
    "sgp_out_peers",
    "simulate",
)
