"""GPU interconnect topology: which GPUs share NVLinks, how many, and at what rate.

Why: Blink packs spanning trees over the links that actually exist (ALGORITHMS.md
5.1); on a partial DGX-1 allocation NCCL's ring falls back to PCIe while trees still
use every NVLink present (5.2). This module turns NVML, ``nvidia-smi topo -m`` text or
(last resort) ``torch.cuda.can_device_access_peer`` into one immutable
:class:`GpuTopology` with a capacity model that the packer consumes.

Capacity model (GB/s per direction, what :meth:`GpuTopology.capacity_matrix` returns):

- Direct NVLink pair with ``n`` bonded links: ``n * link_gbps``. Links are
  point-to-point and full duplex, so pairs do not share capacity.
- NVSwitch (``nvswitch=True``): ``NV#`` is the number of links each GPU has *into the
  switch*, shared by all its peers. A pair gets ``n * link_gbps / max(d_u, d_v)`` where
  ``d`` counts a GPU's NVLink peers among the GPUs asked for, so no GPU is promised
  more than its port (broadcast min cut = one port, the one-hop trees of 5.1.7).
- PCIe (``include_pcie=True``, pairs without NVLink): the same fair share of one
  ``pcie_gbps`` port per GPU. Conservative: it ignores that two GPUs under one switch
  may share an uplink and that ``SYS`` paths (QPI/UPI) are often slower or lack P2P.

Defaults: ``link_gbps`` = 25 (NVLink 2.0-4.0 per link; P100 is 20, GA10x bridges
14.0625; NVML or ``nvidia-smi nvlink -s`` give the real value), ``pcie_gbps`` = 12
(a typical measured PCIe 3.0 x16 peer-to-peer copy; 15.75 is the raw rate).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gossipnet.collectives.blink import _nvml
from gossipnet.collectives.blink._smi import PCIE_PATHS, parse_matrix_text, parse_nvlink_status_text
from gossipnet.errors import TopologyError

__all__ = (
    "DEFAULT_LINK_GBPS",
    "DEFAULT_PCIE_GBPS",
    "MAX_NVLINKS_PER_GPU",
    "GpuTopology",
    "parse_nvlink_status",
    "parse_topo_matrix",
)

DEFAULT_LINK_GBPS = _nvml.DEFAULT_LINK_GBPS
DEFAULT_PCIE_GBPS = 12.0
#: Most NVLinks one GPU has (H100/B200: 18; ``NVML_NVLINK_MAX_LINKS`` today).
MAX_NVLINKS_PER_GPU = 18
_SOURCES = ("nvml", "nvidia-smi", "torch", "text")

Pair = tuple[int, int]


def _pair(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


@dataclass(frozen=True)
class GpuTopology:
    """Immutable NVLink/PCIe graph of the GPUs of one machine.

    Attributes:
        gpus: GPU ids (CUDA device indices when detected), sorted.
        nvlinks: undirected pair ``(i, j)``, ``i < j`` -> bonded NVLinks (``NV#``) that
            are up. With ``nvswitch`` it is each GPU's switch link count.
        pcie: pair without NVLink -> PCIe path kind (``PIX PXB PHB NODE SYS``, or
            ``P2P`` from the torch fallback). ``SOC`` input is stored as ``SYS``.
        link_gbps: GB/s per NVLink per direction.
        pcie_gbps: GB/s per GPU PCIe port per direction.
        nvswitch: GPUs reach each other through an NVSwitch (see module docstring).
        source: ``"nvml"``, ``"nvidia-smi"``, ``"torch"`` or ``"text"``.

    Raises:
        TopologyError: a pair names an unknown GPU, is in both maps, has a count < 1,
            an unknown path kind; rates not positive; unknown source.
    """

    gpus: tuple[int, ...]
    nvlinks: dict[Pair, int] = field(default_factory=dict)
    pcie: dict[Pair, str] = field(default_factory=dict)
    link_gbps: float = DEFAULT_LINK_GBPS
    pcie_gbps: float = DEFAULT_PCIE_GBPS
    nvswitch: bool = False
    source: str = "text"

    def __post_init__(self) -> None:
        gpus = tuple(sorted(int(g) for g in self.gpus))
        if len(set(gpus)) != len(gpus):
            raise TopologyError(f"duplicate GPU ids: {list(self.gpus)}")
        known = set(gpus)
        nvlinks = {_pair(a, b): int(n) for (a, b), n in self.nvlinks.items()}
        pcie = {_pair(a, b): ("SYS" if p == "SOC" else p) for (a, b), p in self.pcie.items()}
        for (a, b), n in nvlinks.items():
            if a == b or a not in known or b not in known or n < 1:
                raise TopologyError(f"bad NVLink entry ({a}, {b}) -> {n} for GPUs {gpus}")
        for (a, b), p in pcie.items():
            if a == b or a not in known or b not in known or p not in PCIE_PATHS:
                raise TopologyError(f"bad PCIe entry ({a}, {b}) -> {p!r} for GPUs {gpus}")
        if nvlinks.keys() & pcie.keys():
            raise TopologyError(
                f"pairs both NVLink and PCIe: {sorted(nvlinks.keys() & pcie.keys())}"
            )
        if not (self.link_gbps > 0 and self.pcie_gbps > 0):
            raise TopologyError(f"rates must be > 0, got {self.link_gbps}, {self.pcie_gbps}")
        if self.source not in _SOURCES:
            raise TopologyError(f"source must be one of {_SOURCES}, got {self.source!r}")
        object.__setattr__(self, "gpus", gpus)
        object.__setattr__(self, "nvlinks", nvlinks)
        object.__setattr__(self, "pcie", pcie)

    def __hash__(self) -> int:
        # dict fields (treat them as read-only) would make the generated hash fail;
        # hashable topologies let packers cache results per topology.
        return hash(
            (
                self.gpus,
                frozenset(self.nvlinks.items()),
                frozenset(self.pcie.items()),
                self.link_gbps,
                self.pcie_gbps,
                self.nvswitch,
                self.source,
            )
        )

    # ------------------------------------------------------------------ views
    def _select(self, gpus: Iterable[int] | None) -> tuple[int, ...]:
        if gpus is None:
            return self.gpus
        chosen = tuple(int(g) for g in gpus)
        unknown = set(chosen) - set(self.gpus)
        if unknown or len(set(chosen)) != len(chosen):
            raise TopologyError(f"GPUs {list(chosen)} not a duplicate-free subset of {self.gpus}")
        return chosen

    def capacity_matrix(
        self, gpus: Sequence[int] | None = None, *, include_pcie: bool = False
    ) -> np.ndarray:
        """k x k GB/s per direction, rows/columns in the order of ``gpus``.

        Symmetric, zero diagonal; see the module docstring for the model. Relays are
        only the GPUs asked for: capacity is computed on the induced subgraph.
        """
        chosen = self._select(gpus)
        pos = {g: i for i, g in enumerate(chosen)}
        cap = np.zeros((len(chosen), len(chosen)), dtype=np.float64)
        for (a, b), gbps in self._pair_capacity(chosen, include_pcie).items():
            cap[pos[a], pos[b]] = cap[pos[b], pos[a]] = gbps
        return cap

    def edges(
        self, gpus: Sequence[int] | None = None, include_pcie: bool = False
    ) -> list[tuple[int, int, float]]:
        """Directed ``(u, v, capacity_gbps)`` between GPU ids, both directions, sorted."""
        chosen = self._select(gpus)
        out: list[tuple[int, int, float]] = []
        for (a, b), gbps in self._pair_capacity(chosen, include_pcie).items():
            out += [(a, b, gbps), (b, a, gbps)]
        return sorted(out)

    def _pair_capacity(self, chosen: Sequence[int], include_pcie: bool) -> dict[Pair, float]:
        inside = set(chosen)
        nv = {p: n for p, n in self.nvlinks.items() if p[0] in inside and p[1] in inside}
        out: dict[Pair, float] = {}
        if self.nvswitch:
            degree = _degrees(nv)
            for (a, b), n in nv.items():
                out[(a, b)] = n * self.link_gbps / max(degree[a], degree[b])
        else:
            out = {p: n * self.link_gbps for p, n in nv.items()}
        if include_pcie:
            pc = [p for p in self.pcie if p[0] in inside and p[1] in inside]
            degree = _degrees(dict.fromkeys(pc, 1))
            for a, b in pc:
                out[(a, b)] = self.pcie_gbps / max(degree[a], degree[b])
        return out

    def islands(self, gpus: Sequence[int] | None = None) -> list[tuple[int, ...]]:
        """Connected components over NVLink pairs (links that are up), sorted.

        A GPU without NVLink to any chosen GPU is its own island. Only chosen GPUs
        relay: two GPUs joined only through an unchosen one are separate islands.
        """
        chosen = self._select(gpus)
        parent = {g: g for g in chosen}

        def root(g: int) -> int:
            while parent[g] != g:
                parent[g] = parent[parent[g]]
                g = parent[g]
            return g

        for a, b in self.nvlinks:
            if a in parent and b in parent:
                ra, rb = root(a), root(b)
                parent[max(ra, rb)] = min(ra, rb)
        groups: dict[int, list[int]] = {}
        for g in chosen:
            groups.setdefault(root(g), []).append(g)
        return sorted(tuple(sorted(m)) for m in groups.values())

    def subset(self, gpus: Sequence[int]) -> GpuTopology:
        """The topology induced by ``gpus`` (ids kept, not renumbered)."""
        inside = set(self._select(gpus))
        return replace(
            self,
            gpus=tuple(sorted(inside)),
            nvlinks={p: n for p, n in self.nvlinks.items() if inside.issuperset(p)},
            pcie={p: k for p, k in self.pcie.items() if inside.issuperset(p)},
        )

    def relabel(self, mapping: Mapping[int, int]) -> GpuTopology:
        """Rename GPU ids (e.g. NVML order -> CUDA order); unmapped GPUs are dropped."""

        def moved(pairs: Mapping[Pair, Any]) -> dict[Pair, Any]:
            return {
                _pair(mapping[a], mapping[b]): v
                for (a, b), v in pairs.items()
                if a in mapping and b in mapping
            }

        return replace(
            self,
            gpus=tuple(sorted(mapping[g] for g in self.gpus if g in mapping)),
            nvlinks=moved(self.nvlinks),
            pcie=moved(self.pcie),
        )

    def with_nvlink_status(self, status: Mapping[int, Sequence[float]]) -> GpuTopology:
        """Apply ``nvidia-smi nvlink -s`` (see :func:`parse_nvlink_status`).

        A pair keeps ``min(NV#, active links of either end)`` links; a pair left with
        none becomes PCIe ``SYS`` (the path is unknown, so the farthest is assumed),
        which can split an island. ``link_gbps`` becomes the slowest active link seen.
        GPUs missing from ``status`` are left as they are. Limitation: the status text
        does not say which link goes to which peer, so for a GPU with several NVLink
        peers and only some links down the counts are an upper bound (NVML is exact).
        """
        active = {g: sum(1 for s in speeds if s > 0) for g, speeds in status.items()}
        nvlinks: dict[Pair, int] = {}
        pcie = dict(self.pcie)
        for (a, b), n in self.nvlinks.items():
            kept = min(n, active.get(a, n), active.get(b, n))
            if kept > 0:
                nvlinks[(a, b)] = kept
            else:
                pcie[(a, b)] = "SYS"
        speeds = [s for g, ss in status.items() if g in self.gpus for s in ss if s > 0]
        rate = min(speeds) if speeds else self.link_gbps
        return replace(self, nvlinks=nvlinks, pcie=pcie, link_gbps=rate)


def _degrees(pairs: Mapping[Pair, Any]) -> dict[int, int]:
    degree: dict[int, int] = {}
    for a, b in pairs:
        degree[a] = degree.get(a, 0) + 1
        degree[b] = degree.get(b, 0) + 1
    return degree


def _looks_like_nvswitch(gpus: Sequence[int], nvlinks: Mapping[Pair, int]) -> bool:
    """Text rule: every pair has the same ``NV#`` n and ``n * (k - 1)`` exceeds what one
    GPU can wire directly (:data:`MAX_NVLINKS_PER_GPU`). DGX A100 (NV12, k=8: 84 > 18)
    and DGX H100 (NV18) qualify; a 4-GPU direct mesh (NV4, k=4: 12) and a 2-GPU bridge
    do not. A switch system seen with k=2 is not flagged, which is harmless: with one
    peer the direct and switch models give the same capacity."""
    k = len(gpus)
    counts = set(nvlinks.values())
    return (
        k >= 3
        and len(nvlinks) == k * (k - 1) // 2
        and len(counts) == 1
        and counts.pop() * (k - 1) > MAX_NVLINKS_PER_GPU
    )


def parse_topo_matrix(
    text: str,
    *,
    link_gbps: float | None = None,
    pcie_gbps: float = DEFAULT_PCIE_GBPS,
    nvswitch: bool | None = None,
    source: str = "text",
) -> GpuTopology:
    """Parse ``nvidia-smi topo -m`` (or ``topo -mp``) output into a :class:`GpuTopology`.

    GPU rows/columns only; NICs, affinity columns and the legend are ignored, the
    header row is not trusted (GPU columns are found from each row's ``X``), tabs or
    spaces both work, ``SOC`` reads as ``SYS``. The text does not name the GPU model,
    so ``link_gbps`` defaults to :data:`DEFAULT_LINK_GBPS`; pass it, or apply
    ``nvidia-smi nvlink -s`` with :meth:`GpuTopology.with_nvlink_status`.

    Args:
        nvswitch: None applies the rule of ``_looks_like_nvswitch`` (text cannot show
            a switch; NVML can); True/False overrides it.

    Raises:
        TopologyError: the text has no parseable GPU matrix (message says why).
    """
    parsed = parse_matrix_text(text)
    switch = _looks_like_nvswitch(parsed.gpus, parsed.nvlinks) if nvswitch is None else nvswitch
    return GpuTopology(
        gpus=parsed.gpus,
        nvlinks=parsed.nvlinks,
        pcie=parsed.pcie,
        link_gbps=DEFAULT_LINK_GBPS if link_gbps is None else float(link_gbps),
        pcie_gbps=float(pcie_gbps),
        nvswitch=switch,
        source=source,
    )


def parse_nvlink_status(text: str) -> dict[int, list[float]]:
    """Parse ``nvidia-smi nvlink -s``: GPU -> per-link GB/s, inactive links 0.0.

    A GPU whose links are all inactive ("Unable to retrieve NVLink information as all
    links are inActive") maps to ``[]``. Combine with a matrix through
    :meth:`GpuTopology.with_nvlink_status`.

    Raises:
        TopologyError: no ``GPU <n>:`` line in the text.
    """
    return parse_nvlink_status_text(text)
