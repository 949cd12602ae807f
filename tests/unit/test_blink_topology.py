"""GPU topology: nvidia-smi text parsing, islands, capacity model, NVML scan, detect().

Fixtures are published ``nvidia-smi`` outputs (tests/fixtures/nvidia-smi-topo/SOURCES.md).
NVML is exercised through a small fake module object; detect() through monkeypatched
torch.cuda and a fake ``nvidia-smi`` script on PATH. No GPU is needed.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from gossipnet.collectives.blink import _detect, _nvml
from gossipnet.collectives.blink.detect import detect
from gossipnet.collectives.blink.topology import (
    DEFAULT_LINK_GBPS,
    GpuTopology,
    parse_nvlink_status,
    parse_topo_matrix,
)
from gossipnet.errors import ConfigError, GossipError, TopologyError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi-topo"

# ALGORITHMS.md 5.2: DGX-1V NVLink counts (rows sum to 6).
DGX1V = np.array(
    [
        [0, 1, 1, 2, 2, 0, 0, 0],
        [1, 0, 2, 1, 0, 2, 0, 0],
        [1, 2, 0, 2, 0, 0, 1, 0],
        [2, 1, 2, 0, 0, 0, 0, 1],
        [2, 0, 0, 0, 0, 1, 1, 2],
        [0, 2, 0, 0, 1, 0, 2, 1],
        [0, 0, 1, 0, 1, 2, 0, 2],
        [0, 0, 0, 1, 2, 1, 2, 0],
    ]
)


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def _nv_matrix(topo: GpuTopology) -> np.ndarray:
    m = np.zeros((len(topo.gpus), len(topo.gpus)), dtype=int)
    for (a, b), n in topo.nvlinks.items():
        m[a, b] = m[b, a] = n
    return m


def _synthetic(k: int, cell: str, nics: int = 2) -> str:
    """A topo -m matrix with every GPU pair ``cell``, NIC columns and a legend."""
    head = "\t" + "\t".join([f"GPU{i}" for i in range(k)] + [f"NIC{i}" for i in range(nics)])
    rows = [head + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for i in range(k):
        cells = [" X " if j == i else cell for j in range(k)] + ["SYS"] * nics
        rows.append(f"GPU{i}\t" + "\t".join(cells) + "\t0-55\t0\t\tN/A")
    rows += ["", "Legend:", "", "  X    = Self", "  NV#  = Connection traversing NVLinks"]
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------ text fixtures
def test_dgx1_v100_matches_algorithms_table() -> None:
    topo = parse_topo_matrix(_fixture("dgx1-v100.txt"))
    assert topo.gpus == tuple(range(8))
    np.testing.assert_array_equal(_nv_matrix(topo), DGX1V)
    assert (_nv_matrix(topo).sum(axis=1) == 6).all()
    assert not topo.nvswitch
    assert topo.source == "text"
    assert topo.islands() == [tuple(range(8))]
    assert topo.pcie[(0, 5)] == "SYS"
    assert len(topo.nvlinks) + len(topo.pcie) == 28


def test_dgx1_p100_damaged_header_parses() -> None:
    topo = parse_topo_matrix(_fixture("dgx1-p100.txt"))
    m = _nv_matrix(topo)
    assert topo.gpus == tuple(range(8))
    assert (m.sum(axis=1) == 4).all()
    expected = {(a, b) for a in range(4) for b in range(a + 1, 4)}
    expected |= {(a + 4, b + 4) for a, b in expected} | {(i, i + 4) for i in range(4)}
    assert set(topo.nvlinks) == expected
    assert set(topo.nvlinks.values()) == {1}
    assert set(topo.pcie.values()) == {"SYS"}  # SOC is read as SYS


def test_dgx_a100_nvswitch() -> None:
    topo = parse_topo_matrix(_fixture("dgx-a100-nvswitch.txt"))
    assert topo.gpus == tuple(range(8))
    assert len(topo.nvlinks) == 28
    assert set(topo.nvlinks.values()) == {12}
    assert topo.nvswitch
    assert topo.pcie == {}
    # one port of 12 links shared by all peers: every GPU can push 300 GB/s in total
    for gpus in [range(8), (0, 5, 7), (2, 3)]:
        cap = topo.capacity_matrix(list(gpus))
        np.testing.assert_allclose(cap.sum(axis=1), 12 * DEFAULT_LINK_GBPS)


def test_pcie_only_rtx4090() -> None:
    topo = parse_topo_matrix(_fixture("pcie-only-8x-rtx4090.txt"))
    assert topo.gpus == tuple(range(8))
    assert topo.nvlinks == {}
    assert topo.islands() == [(g,) for g in range(8)]
    assert set(topo.pcie.values()) == {"SYS"}
    assert len(topo.pcie) == 28
    assert not topo.capacity_matrix().any()
    cap = topo.capacity_matrix(include_pcie=True)
    np.testing.assert_allclose(cap.sum(axis=1), topo.pcie_gbps)  # fair share of one port


def test_a6000_partial_nvlink() -> None:
    topo = parse_topo_matrix(_fixture("rtx-a6000-partial-nvlink.txt"))
    assert topo.gpus == (0, 1, 2)
    assert topo.nvlinks == {(0, 1): 4}
    assert topo.pcie == {(0, 2): "NODE", (1, 2): "NODE"}
    assert topo.islands() == [(0, 1), (2,)]
    assert not topo.nvswitch


def test_topo_mp_has_no_nvlink() -> None:
    topo = parse_topo_matrix(_fixture("dgx1-pcie-only-topo-mp.txt"))
    assert topo.gpus == tuple(range(8))
    assert topo.nvlinks == {}
    assert topo.pcie[(0, 1)] == "PIX"
    assert topo.pcie[(0, 2)] == "PHB"
    assert topo.pcie[(0, 4)] == "SYS"
    assert len(topo.islands()) == 8


def test_synthetic_dgx_h100_nv18() -> None:
    topo = parse_topo_matrix(_synthetic(8, "NV18"))
    assert set(topo.nvlinks.values()) == {18}
    assert len(topo.nvlinks) == 28
    assert topo.nvswitch
    np.testing.assert_allclose(topo.capacity_matrix().sum(axis=1), 18 * DEFAULT_LINK_GBPS)


def test_nvswitch_rule_and_override() -> None:
    # a 4-GPU direct mesh (NV4 each pair, 12 links per GPU) is not a switch
    mesh = parse_topo_matrix(_synthetic(4, "NV4"))
    assert not mesh.nvswitch
    np.testing.assert_allclose(mesh.capacity_matrix()[0, 1], 4 * DEFAULT_LINK_GBPS)
    assert not parse_topo_matrix(_synthetic(2, "NV12")).nvswitch
    assert parse_topo_matrix(_synthetic(4, "NV4"), nvswitch=True).nvswitch


def test_spaces_instead_of_tabs_and_crlf() -> None:
    text = _fixture("dgx1-v100.txt")
    spaced = text.replace("\t", "    ").replace(" X ", "X")
    np.testing.assert_array_equal(_nv_matrix(parse_topo_matrix(spaced)), DGX1V)
    np.testing.assert_array_equal(_nv_matrix(parse_topo_matrix(text.replace("\n", "\r\n"))), DGX1V)


def test_link_rate_override() -> None:
    topo = parse_topo_matrix(_fixture("dgx1-p100.txt"), link_gbps=20.0)
    assert topo.capacity_matrix()[0, 1] == pytest.approx(20.0)
    v100 = parse_topo_matrix(_fixture("dgx1-v100.txt"), link_gbps=25.0)
    np.testing.assert_allclose(v100.capacity_matrix().sum(axis=1), 150.0)  # 5.4 item 2


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "no GPU rows"),
        ("hello world\n", "no GPU rows"),
        ("\tGPU0\tGPU1\n", "no GPU rows"),  # header only
        ("GPU0\t X \tNV1\nGPU1\tNV2\t X \n", "asymmetric.*NV1.*NV2"),
        ("GPU0\t X \tFOO\nGPU1\tFOO\t X \n", "unknown connection 'FOO'"),
        ("GPU0\t X \tNV0\nGPU1\tNV0\t X \n", "must be positive"),
        ("GPU0\tNV1\t X \nGPU1\t X \tNV1\n", "self cell 'X' at column 1"),
        ("GPU0\t X \tNV1\nGPU0\tNV1\t X \n", "duplicate GPU rows"),
        ("GPU0\t X \nGPU1\tNV1\t X \n", "needs 2 GPU columns"),
    ],
)
def test_garbage_raises_clear_error(text: str, reason: str) -> None:
    with pytest.raises(TopologyError, match=reason) as info:
        parse_topo_matrix(text)
    assert isinstance(info.value, ConfigError)
    assert isinstance(info.value, GossipError)
    assert isinstance(info.value, ValueError)


def test_non_string_raises() -> None:
    with pytest.raises(TopologyError, match="must be str"):
        parse_topo_matrix(b"GPU0\t X \n")  # type: ignore[arg-type]


# ------------------------------------------------------------------ nvlink status
def test_nvlink_status_fixture() -> None:
    status = parse_nvlink_status(_fixture("rtx-a6000-nvlink-status.txt"))
    assert status == {0: [14.062] * 4, 1: [14.062] * 4, 2: []}


def test_nvlink_status_variants_and_errors() -> None:
    text = "GPU 0: X (UUID: GPU-1)\n\t Link 0: <inactive>\n\t Link 2: 25000 MB/s\n"
    assert parse_nvlink_status(text) == {0: [0.0, 0.0, 25.0]}
    with pytest.raises(TopologyError):
        parse_nvlink_status("nothing here\n")
    with pytest.raises(TopologyError):
        parse_nvlink_status("\t Link 0: 25 GB/s\n")


def test_status_splits_islands_and_sets_rate() -> None:
    topo = parse_topo_matrix(_fixture("rtx-a6000-partial-nvlink.txt"))
    merged = topo.with_nvlink_status(parse_nvlink_status(_fixture("rtx-a6000-nvlink-status.txt")))
    assert merged.islands() == [(0, 1), (2,)]
    assert merged.link_gbps == pytest.approx(14.062)
    assert merged.capacity_matrix()[0, 1] == pytest.approx(4 * 14.062)
    # GPU1's links all inactive: the NVLink pair is gone, the island splits
    down = topo.with_nvlink_status({0: [14.062] * 4, 1: [0.0] * 4, 2: []})
    assert down.islands() == [(0,), (1,), (2,)]
    assert down.nvlinks == {}
    assert down.pcie[(0, 1)] == "SYS"
    # two of four links up: the pair keeps two
    half = topo.with_nvlink_status({0: [25.0, 25.0, 0.0, 0.0]})
    assert half.nvlinks == {(0, 1): 2}


# ------------------------------------------------------------------ model
def test_subset_edges_islands_on_partial_dgx1v() -> None:
    topo = parse_topo_matrix(_fixture("dgx1-v100.txt"))
    # ALGORITHMS.md 5.2: {0,1,6} is NVLink-disconnected
    assert topo.islands([0, 1, 6]) == [(0, 1), (6,)]
    sub = topo.subset([6, 0, 1])
    assert sub.gpus == (0, 1, 6)
    assert sub.nvlinks == {(0, 1): 1}
    assert set(sub.pcie) == {(0, 6), (1, 6)}
    edges = topo.edges([0, 1, 5])
    assert edges == sorted(
        [(0, 1, 25.0), (1, 0, 25.0), (1, 5, 50.0), (5, 1, 50.0)]
    )  # 5-0 is not NVLink
    with_pcie = topo.edges([0, 1, 5], include_pcie=True)
    assert (0, 5, topo.pcie_gbps) in with_pcie
    assert (5, 0, topo.pcie_gbps) in with_pcie
    cap = topo.capacity_matrix([5, 1, 0])  # caller's order
    assert cap[0, 1] == 50.0
    assert cap[1, 2] == 25.0
    assert cap[0, 2] == 0.0
    np.testing.assert_array_equal(cap, cap.T)
    # relays only through chosen GPUs: 0 and 5 meet only via 1
    assert topo.islands([0, 5]) == [(0,), (5,)]


def test_validation() -> None:
    with pytest.raises(TopologyError):
        GpuTopology(gpus=(0, 1), nvlinks={(0, 2): 1})
    with pytest.raises(TopologyError):
        GpuTopology(gpus=(0, 1), nvlinks={(0, 1): 1}, pcie={(1, 0): "PIX"})
    with pytest.raises(TopologyError):
        GpuTopology(gpus=(0, 1), pcie={(0, 1): "QPI"})
    with pytest.raises(TopologyError):
        GpuTopology(gpus=(0, 1), link_gbps=0.0)
    with pytest.raises(TopologyError):
        GpuTopology(gpus=(0, 1), source="magic")
    topo = GpuTopology(gpus=(1, 0), nvlinks={(1, 0): 2}, pcie={})
    assert topo.gpus == (0, 1)
    assert topo.nvlinks == {(0, 1): 2}
    with pytest.raises(TopologyError):
        topo.capacity_matrix([0, 3])
    assert topo.relabel({0: 5, 1: 3}).nvlinks == {(3, 5): 2}
    same = GpuTopology(gpus=(0, 1), nvlinks={(0, 1): 2})
    assert hash(same) == hash(topo)
    assert same == topo
    assert len({same, topo, topo.subset([0])}) == 2


# ------------------------------------------------------------------ fake NVML
class FakeNVMLError(Exception):
    pass


class _Pci:
    def __init__(self, bus: int) -> None:
        self.domain, self.bus, self.device = 0, bus, 0
        self.busId = f"00000000:{bus:02X}:00.0".encode()


class _RemotePci:
    """Only a 4-digit-domain busId string, like the legacy field: exercises parsing."""

    def __init__(self, bus: int) -> None:
        self.busId = f"0000:{bus:02x}:00.0"


class FakeNvml:
    """The slice of pynvml (nvidia-ml-py 13 names) that ``_nvml.scan`` uses.

    ``links[g]`` lists each link's far end: a GPU index, ``"switch"`` or ``"cpu"``;
    ``down`` holds (gpu, link) pairs whose state reads disabled."""

    NVMLError = FakeNVMLError
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
    NVML_NVLINK_MAX_LINKS = 36

    def __init__(
        self,
        links: dict[int, list[int | str]],
        *,
        capability: tuple[int, int] | None = (7, 0),
        version: int = 2,
        down: frozenset[tuple[int, int]] = frozenset(),
        fail_init: bool = False,
    ) -> None:
        self.links, self.capability, self.version = links, capability, version
        self.down, self.fail_init = down, fail_init
        self.initialised = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise FakeNVMLError("Driver Not Loaded")
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.links)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPciInfo(self, h: int) -> _Pci:
        return _Pci(0x10 + h)

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:08d}"

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        if self.capability is None:
            raise FakeNVMLError("Not Supported")
        return self.capability

    def _end(self, h: int, link: int) -> int | str:
        if link >= len(self.links[h]):
            raise FakeNVMLError("Invalid Argument")
        return self.links[h][link]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        self._end(h, link)
        return 0 if (h, link) in self.down else 1

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> int:
        self._end(h, link)
        return self.version

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return 2 if self._end(h, link) == "switch" else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> _RemotePci:
        end = self._end(h, link)
        if end == "switch":
            raise FakeNVMLError("Not a GPU")
        return _RemotePci(0xFE if end == "cpu" else 0x10 + int(end))

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 10 if a // 4 == b // 4 else 50


def _dgx1v_links() -> dict[int, list[int | str]]:
    return {i: [j for j in range(8) for _ in range(DGX1V[i, j])] for i in range(8)}


def test_nvml_scan_dgx1v() -> None:
    fake = FakeNvml(_dgx1v_links())
    found = _nvml.scan(fake)
    topo = GpuTopology(gpus=found.gpus, nvlinks=found.nvlinks, pcie=found.pcie)
    np.testing.assert_array_equal(_nv_matrix(topo), DGX1V)
    assert found.link_gbps == 25.0
    assert not found.nvswitch
    assert set(found.pcie) == {(a, b) for a in range(8) for b in range(a + 1, 8) if not DGX1V[a, b]}
    assert set(found.pcie.values()) == {"SYS"}  # no NVLink-less pair shares a quad
    assert found.uuids[3] == "GPU-00000003"
    assert fake.initialised == 0  # shut down again


def test_nvml_scan_down_link_and_cpu_end() -> None:
    links = _dgx1v_links()
    down_link = links[0].index(3)  # one of GPU0's two links to GPU3
    links[1].append("cpu")  # an NVLink to a CPU (POWER9) is not a GPU pair
    found = _nvml.scan(FakeNvml(links, down=frozenset({(0, down_link)})))
    assert found.nvlinks[(0, 3)] == 1
    assert found.nvlinks[(0, 4)] == 2
    # GPU0's only links to 1 and 2 down: GPU0 loses them
    cut = {(0, i) for i, end in enumerate(_dgx1v_links()[0]) if end in (1, 2)}
    assert (0, 1) not in _nvml.scan(FakeNvml(_dgx1v_links(), down=frozenset(cut))).nvlinks


def test_nvml_scan_nvswitch_and_rates() -> None:
    fake = FakeNvml({i: ["switch"] * 12 for i in range(8)}, capability=(8, 0), version=4)
    found = _nvml.scan(fake)
    assert found.nvswitch
    assert len(found.nvlinks) == 28
    assert set(found.nvlinks.values()) == {12}
    assert found.pcie == {}
    ga10x = _nvml.scan(FakeNvml({0: [1] * 4, 1: [0] * 4}, capability=(8, 6), version=4))
    assert ga10x.link_gbps == pytest.approx(14.0625)
    p100 = _nvml.scan(FakeNvml({0: [1], 1: [0]}, capability=None, version=1))
    assert p100.link_gbps == 20.0
    unknown = _nvml.scan(FakeNvml({0: [1], 1: [0]}, capability=None, version=99))
    assert unknown.link_gbps == _nvml.DEFAULT_LINK_GBPS


def test_nvml_old_binding_without_remote_type() -> None:
    fake = FakeNvml(_dgx1v_links())
    fake.nvmlDeviceGetNvLinkRemoteDeviceType = None  # type: ignore[assignment,method-assign]
    np.testing.assert_array_equal(
        _nv_matrix(GpuTopology(gpus=tuple(range(8)), nvlinks=_nvml.scan(fake).nvlinks)), DGX1V
    )


# ------------------------------------------------------------------ detect()
@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the no-GPU path for real")
def test_detect_returns_none_without_gpu(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="gossipnet.collectives.blink._detect"):
        assert detect() is None
    assert "no CUDA device" in caplog.text


def test_detect_none_when_torch_sees_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert detect(nvml_module=FakeNvml({0: [1], 1: [0]})) is None


@pytest.fixture
def two_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi


@pytest.mark.usefixtures("two_fake_gpus")
def test_detect_uses_fake_nvml() -> None:
    topo = detect(nvml_module=FakeNvml({0: [1, 1], 1: [0, 0]}))
    assert topo is not None
    assert topo.source == "nvml"
    assert topo.nvlinks == {(0, 1): 2}
    assert topo.islands() == [(0, 1)]


@pytest.mark.usefixtures("two_fake_gpus")
def test_detect_maps_nvml_order_to_cuda_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA sees NVML GPU 1 as device 0 and NVML GPU 2 as device 1; NVML GPU 0 hidden
    monkeypatch.setattr(_detect, "_cuda_info", lambda: (2, ["00000001", "00000002"], (7, 0)))
    fake = FakeNvml({0: [2], 1: [2, 2], 2: [0, 1, 1]})
    topo = detect(nvml_module=fake, smi=False)
    assert topo is not None
    assert topo.gpus == (0, 1)
    assert topo.nvlinks == {(0, 1): 2}


@pytest.mark.usefixtures("two_fake_gpus")
def test_detect_falls_back_to_torch_p2p(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="gossipnet.collectives.blink._detect"):
        topo = detect(nvml_module=FakeNvml({0: [], 1: []}, fail_init=True))
    assert topo is not None
    assert topo.source == "torch"
    assert topo.nvlinks == {}
    assert topo.pcie == {(0, 1): "P2P"}
    assert topo.islands() == [(0,), (1,)]
    assert "Driver Not Loaded" in caplog.text
    assert "nvidia-smi not on PATH" in caplog.text
    assert detect(nvml=False, smi=False) == topo


def _fake_smi(tmp_path: Path, body: str) -> None:
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def test_detect_via_fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    topo_file = FIXTURES / "rtx-a6000-partial-nvlink.txt"
    status_file = FIXTURES / "rtx-a6000-nvlink-status.txt"
    _fake_smi(
        tmp_path,
        f'case "$1" in\n topo) cat "{topo_file}" ;;\n nvlink) cat "{status_file}" ;;\n'
        ' *) printf "0, GPU-a\\n1, GPU-b\\n2, GPU-c\\n" ;;\nesac\n',
    )
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    # CUDA order reversed relative to nvidia-smi's PCI order
    monkeypatch.setattr(_detect, "_cuda_info", lambda: (3, ["c", "b", "a"], (8, 6)))
    topo = detect(nvml=False)
    assert topo is not None
    assert topo.source == "nvidia-smi"
    assert topo.nvlinks == {(1, 2): 4}
    assert topo.islands() == [(0,), (1, 2)]
    assert topo.link_gbps == pytest.approx(14.062)


def test_detect_smi_timeout_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, "exec sleep 30\n")  # a hung driver call
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(_detect, "_cuda_info", lambda: (2, None, None))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    topo = detect(nvml=False, timeout_s=0.3)
    assert topo is not None
    assert topo.source == "torch"
    assert topo.pcie == {}
