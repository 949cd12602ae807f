"""Read the NVLink graph from NVML (``pynvml``, package ``nvidia-ml-py``).

Why NVML first: ``nvidia-smi topo -m`` prints one ``NV#`` per pair and cannot say
whether the far end is a GPU or an NVSwitch, nor which links are down; NVML reports
every link: its state, its remote PCI address (-> which GPU), its remote device type
(GPU or switch) and its version (ALGORITHMS.md 5.3).

The module object is a parameter (:func:`scan`), so tests drive the same code with a
small fake; nothing here imports ``pynvml``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ("NvmlScan", "link_gbps_for", "scan")

logger = logging.getLogger(__name__)

#: Per-link, per-direction GB/s by NVML's ``nvmlNvlinkVersion_t`` value (1 = 1.0,
#: 2 = 2.0, 3 = 2.2, 4 = 3.0, 5 = 3.1, 6 = 4.0, 7 = 5.0). NVLink 1: 20 (P100);
#: 2.x-4.0: 25 (V100 6x25, A100 12x25, H100 18x25); 5.0: 50 (B200 18x50).
NVLINK_GBPS_BY_VERSION: dict[int, float] = {
    1: 20.0,
    2: 25.0,
    3: 25.0,
    4: 25.0,
    5: 25.0,
    6: 25.0,
    7: 50.0,
}
#: Per-link GB/s by CUDA compute capability. Preferred over the version: some drivers
#: report Hopper as 5.0, and GA10x bridges (RTX A6000, 3090: NVLink 3 at 14.0625 GB/s,
#: which ``nvidia-smi nvlink -s`` prints as 14.062) share A100's version.
NVLINK_GBPS_BY_CAPABILITY: dict[tuple[int, int], float] = {
    (6, 0): 20.0,
    (7, 0): 25.0,
    (8, 0): 25.0,
    (8, 6): 14.0625,
    (9, 0): 25.0,
    (10, 0): 50.0,
}
#: Used when neither table knows the GPU (documented default: NVLink 2-4 per link).
DEFAULT_LINK_GBPS = 25.0

# Constants from nvml.h, used when the module object lacks them (old pynvml, fakes).
_FEATURE_ENABLED = 1
_DEVICE_TYPE_SWITCH = 2
_MAX_LINKS = 36  # nvidia-ml-py 13; links past a GPU's count just error
_ANCESTOR_TO_PATH = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class NvmlScan(NamedTuple):
    """Plain result of :func:`scan`; GPU ids are NVML indices unless remapped."""

    gpus: tuple[int, ...]
    nvlinks: dict[tuple[int, int], int]
    pcie: dict[tuple[int, int], str]
    link_gbps: float
    nvswitch: bool
    uuids: tuple[str, ...]


def link_gbps_for(capability: tuple[int, int] | None, version: int | None) -> float:
    """Per-link GB/s from compute capability, else NVLink version, else the default."""
    if capability is not None and capability in NVLINK_GBPS_BY_CAPABILITY:
        return NVLINK_GBPS_BY_CAPABILITY[capability]
    if version is not None and version in NVLINK_GBPS_BY_VERSION:
        return NVLINK_GBPS_BY_VERSION[version]
    return DEFAULT_LINK_GBPS


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pci_key(info: Any) -> tuple[int, int, int]:
    """(domain, bus, device) of an ``nvmlPciInfo_t``; the function number is ignored.

    The ``busId`` string's domain width differs between structs (8 vs 4 hex digits),
    so the integer fields are used when present.
    """
    if all(hasattr(info, f) for f in ("domain", "bus", "device")):
        return (int(info.domain), int(info.bus), int(info.device))
    domain, bus, rest = _text(info.busId).strip().lower().split(":")
    return (int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16))


def _call(nvml: Any, names: Sequence[str], *args: Any) -> Any:
    """Call the first of ``names`` the module has (``_v2`` before the old name)."""
    for name in names:
        fn = getattr(nvml, name, None)
        if fn is not None:
            return fn(*args)
    raise AttributeError(f"NVML module has none of {list(names)}")


def _link_ends(
    nvml: Any, handle: Any, by_pci: dict[tuple[int, int, int], int]
) -> tuple[Counter[int], int, list[int]]:
    """Active links of one GPU: Counter of GPU peers, count of switch links, versions."""
    error = getattr(nvml, "NVMLError", Exception)
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", _FEATURE_ENABLED)
    switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", _DEVICE_TYPE_SWITCH)
    peers: Counter[int] = Counter()
    switch_links = 0
    versions: list[int] = []
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", _MAX_LINKS))):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != enabled:
                continue
        except error:  # link index past this GPU's count, or NVLink unsupported
            continue
        with contextlib.suppress(error):  # version only refines the rate
            versions.append(int(nvml.nvmlDeviceGetNvLinkVersion(handle, link)))
        remote_type = getattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
        try:  # old binding (None) or driver (error): assume a GPU and check its PCI id
            kind = remote_type(handle, link) if remote_type is not None else None
        except error:
            kind = None
        if kind == switch_type:
            switch_links += 1
            continue
        try:
            remote = _call(
                nvml,
                ("nvmlDeviceGetNvLinkRemotePciInfo_v2", "nvmlDeviceGetNvLinkRemotePciInfo"),
                handle,
                link,
            )
        except error:
            continue
        peer = by_pci.get(_pci_key(remote))
        if peer is not None:  # None: a CPU/NPU end (POWER9) or a GPU not visible here
            peers[peer] += 1
    return peers, switch_links, versions


def _capability(nvml: Any, handle: Any) -> tuple[int, int] | None:
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except Exception:  # old binding or driver; the version table is the fallback
        return None
    return (int(major), int(minor))


def scan(nvml: Any) -> NvmlScan:
    """Walk every link of every GPU through the NVML module object ``nvml``.

    Pair counts are the minimum of what the two ends report (a link up on one end
    only is not usable). GPUs with links to an NVSwitch are fully connected among
    themselves with ``min(switch links of the two)`` links (ALGORITHMS.md 5.3).
    ``link_gbps`` is the lowest per-link rate seen (conservative for mixed systems).

    Raises:
        Whatever ``nvml`` raises from ``nvmlInit``/``nvmlDeviceGetCount``; per-link and
        per-pair errors are skipped. :func:`.detect.detect` catches and logs.
    """
    nvml.nvmlInit()
    try:
        count = int(nvml.nvmlDeviceGetCount())
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        by_pci = {_pci_key(nvml.nvmlDeviceGetPciInfo(h)): i for i, h in enumerate(handles)}
        directed: dict[tuple[int, int], int] = {}
        switch_links: dict[int, int] = {}
        rates: list[float] = []
        for i, handle in enumerate(handles):
            peers, on_switch, versions = _link_ends(nvml, handle, by_pci)
            directed.update({(i, j): n for j, n in peers.items() if j != i})
            if on_switch:
                switch_links[i] = on_switch
            if peers or on_switch:
                cap = _capability(nvml, handle)
                rates.append(link_gbps_for(cap, min(versions) if versions else None))
        nvlinks = {
            (i, j): min(n, directed.get((j, i), 0))
            for (i, j), n in directed.items()
            if i < j and min(n, directed.get((j, i), 0)) > 0
        }
        on_sw = sorted(switch_links)
        for a_pos, a in enumerate(on_sw):
            for b in on_sw[a_pos + 1 :]:
                nvlinks[(a, b)] = max(nvlinks.get((a, b), 0), min(switch_links[a], switch_links[b]))
        pcie = _pcie_paths(nvml, handles, nvlinks)
        ids = tuple(_uuid(nvml, h) for h in handles)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # shutdown failure must not hide the scan result or error
            logger.debug("nvmlShutdown failed", exc_info=True)
    return NvmlScan(
        gpus=tuple(range(count)),
        nvlinks=nvlinks,
        pcie=pcie,
        link_gbps=min(rates) if rates else DEFAULT_LINK_GBPS,
        nvswitch=bool(switch_links),
        uuids=ids,
    )


def _uuid(nvml: Any, handle: Any) -> str:
    """``GPU-...`` UUID, or "" when the binding cannot say (then no remapping)."""
    try:
        return _text(nvml.nvmlDeviceGetUUID(handle))
    except Exception:  # optional: only used to map NVML order to CUDA order
        return ""


def _pcie_paths(
    nvml: Any, handles: Sequence[Any], nvlinks: dict[tuple[int, int], int]
) -> dict[tuple[int, int], str]:
    """PCIe path kind of each pair without NVLink (``nvmlDeviceGetTopologyCommonAncestor``)."""
    error = getattr(nvml, "NVMLError", Exception)
    out: dict[tuple[int, int], str] = {}
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            if (i, j) in nvlinks:
                continue
            try:
                level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]))
            except (error, AttributeError):
                logger.debug("no PCIe ancestor for GPU%d-GPU%d; assuming SYS", i, j)
                level = 50
            out[(i, j)] = _ANCESTOR_TO_PATH.get(level, "SYS")
    return out
