"""Find this machine's GPU topology: :func:`detect`.

Why its own module: detection probes torch.cuda, NVML and a subprocess
(:mod:`._detect`), which build on the pure model and parsers of :mod:`.topology`;
kept here, above both, the model never imports the probing back.
"""

from __future__ import annotations

from typing import Any

from gossipnet.collectives.blink._detect import detect_topology
from gossipnet.collectives.blink.topology import GpuTopology

__all__ = ("detect",)


def detect(
    *,
    nvml: bool = True,
    smi: bool = True,
    nvml_module: Any = None,
    timeout_s: float = 10.0,
) -> GpuTopology | None:
    """Find this machine's GPU topology; never raises for a missing GPU or driver.

    Order (ALGORITHMS.md 5.3): NVML (``pynvml``, extra ``gossipnet[gpu]``), then
    ``nvidia-smi topo -m`` (+ ``nvlink -s`` for link rates) run with ``timeout_s``,
    then ``torch.cuda.can_device_access_peer``, which cannot tell NVLink from PCIe:
    that fallback claims no NVLink (islands of one) and records P2P-capable pairs as
    PCIe ``"P2P"``. NVML/nvidia-smi number GPUs in PCI order; ids are mapped to CUDA
    indices by UUID (so ``CUDA_VISIBLE_DEVICES`` is respected). Why a source was
    skipped is logged at debug level.

    Args:
        nvml_module: an object with pynvml's API, used instead of importing pynvml
            (tests pass a fake).

    Returns:
        The topology of the visible CUDA devices, or None when there are none.
    """
    return detect_topology(nvml=nvml, smi=smi, nvml_module=nvml_module, timeout_s=timeout_s)
