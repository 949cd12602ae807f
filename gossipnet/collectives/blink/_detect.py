"""Detection sources behind :func:`gossipnet.collectives.blink.detect.detect`.

Why a separate module: probing (torch.cuda, NVML, a subprocess) is kept apart from the
pure topology model and parsers, and is imported only when ``detect()`` runs.
Every source failure is logged at debug level and means "try the next one".
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from gossipnet.collectives.blink import _nvml
from gossipnet.collectives.blink.topology import GpuTopology, parse_nvlink_status, parse_topo_matrix
from gossipnet.errors import TopologyError

__all__ = ("detect_topology",)

logger = logging.getLogger(__name__)


def detect_topology(
    *, nvml: bool, smi: bool, nvml_module: Any, timeout_s: float
) -> GpuTopology | None:
    """NVML, then nvidia-smi, then torch P2P; None without CUDA devices (see ``detect``)."""
    count, cuda_uuids, capability = _cuda_info()
    if count == 0:
        logger.debug("topology detect: no CUDA device visible to torch")
        return None
    attempts: tuple[tuple[bool, Callable[[], GpuTopology | None]], ...] = (
        (nvml, lambda: _via_nvml(nvml_module, cuda_uuids)),
        (smi, lambda: _via_smi(timeout_s, cuda_uuids, capability)),
    )
    for enabled, attempt in attempts:
        if not enabled:
            continue
        try:
            topo = attempt()
        except Exception as err:  # any driver/tool failure means "try the next source"
            logger.debug("topology detect: source failed: %r", err)
            continue
        if topo is not None and len(topo.gpus) == count:
            return topo
        if topo is not None:
            logger.debug("topology detect: source saw %d of %d GPUs", len(topo.gpus), count)
    return _via_torch(count, capability)


def _cuda_info() -> tuple[int, list[str] | None, tuple[int, int] | None]:
    """(device count, normalised UUIDs or None, capability of device 0 or None)."""
    try:
        import torch

        count = int(torch.cuda.device_count())
    except Exception as err:  # a broken CUDA install must not break training setup
        logger.debug("topology detect: torch.cuda unavailable: %r", err)
        return 0, None, None
    if count == 0:
        return 0, None, None
    uuids: list[str] | None = None
    capability: tuple[int, int] | None = None
    try:
        uuids = [_norm_uuid(str(torch.cuda.get_device_properties(i).uuid)) for i in range(count)]
        major, minor = torch.cuda.get_device_capability(0)
        capability = (int(major), int(minor))
    except Exception as err:  # older torch: no uuid; fall back to identity mapping
        logger.debug("topology detect: no CUDA UUIDs/capability: %r", err)
    return count, uuids, capability


def _norm_uuid(uuid: str) -> str:
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def _to_cuda(
    topo: GpuTopology, tool_uuids: Sequence[str], cuda_uuids: list[str] | None
) -> GpuTopology:
    """Map tool (PCI-order) ids to CUDA ids by UUID; identity when UUIDs are unknown."""
    if cuda_uuids is None or not all(tool_uuids):
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            logger.debug("topology detect: CUDA_VISIBLE_DEVICES set but no UUIDs to map ids")
        return topo
    where = {u: i for i, u in enumerate(cuda_uuids)}
    mapping = {
        g: where[_norm_uuid(u)]
        for g, u in zip(topo.gpus, tool_uuids, strict=False)
        if _norm_uuid(u) in where
    }
    return topo.relabel(mapping)


def _via_nvml(module: Any, cuda_uuids: list[str] | None) -> GpuTopology | None:
    if module is None:
        try:
            import pynvml as module  # type: ignore[import-not-found, no-redef]
        except ImportError:
            logger.debug("topology detect: pynvml missing (pip install 'gossipnet[gpu]')")
            return None
    found = _nvml.scan(module)
    topo = GpuTopology(
        gpus=found.gpus,
        nvlinks=found.nvlinks,
        pcie=found.pcie,
        link_gbps=found.link_gbps,
        nvswitch=found.nvswitch,
        source="nvml",
    )
    return _to_cuda(topo, found.uuids, cuda_uuids)


def _run_smi(exe: str, args: Sequence[str], timeout_s: float) -> str:
    done = subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=timeout_s, check=True
    )
    return done.stdout


def _via_smi(
    timeout_s: float, cuda_uuids: list[str] | None, capability: tuple[int, int] | None
) -> GpuTopology | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        logger.debug("topology detect: nvidia-smi not on PATH")
        return None
    topo = parse_topo_matrix(
        _run_smi(exe, ("topo", "-m"), timeout_s),
        link_gbps=_nvml.link_gbps_for(capability, None),
        source="nvidia-smi",
    )
    if topo.nvlinks:
        try:
            topo = topo.with_nvlink_status(
                parse_nvlink_status(_run_smi(exe, ("nvlink", "-s"), timeout_s))
            )
        except (subprocess.SubprocessError, OSError, TopologyError) as err:
            logger.debug("topology detect: nvlink -s unusable, keeping NV# counts: %r", err)
    csv = _run_smi(exe, ("--query-gpu=index,uuid", "--format=csv,noheader"), timeout_s)
    by_index = dict(line.split(",", 1) for line in csv.splitlines() if "," in line)
    tool_uuids = [by_index.get(str(g), "").strip() for g in topo.gpus]
    return _to_cuda(topo, tool_uuids, cuda_uuids)


def _via_torch(count: int, capability: tuple[int, int] | None) -> GpuTopology | None:
    """P2P-only fallback: no NVLink claimed, peer-accessible pairs recorded as "P2P"."""
    try:
        import torch

        pcie = {
            (i, j): "P2P"
            for i in range(count)
            for j in range(i + 1, count)
            if torch.cuda.can_device_access_peer(i, j) and torch.cuda.can_device_access_peer(j, i)
        }
    except Exception as err:  # driver error: still report the GPUs, with no links
        logger.debug("topology detect: can_device_access_peer failed: %r", err)
        pcie = {}
    return GpuTopology(
        gpus=tuple(range(count)),
        pcie=pcie,
        link_gbps=_nvml.link_gbps_for(capability, None),
        source="torch",
    )
