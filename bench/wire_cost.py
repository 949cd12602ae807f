"""Instructions per data packet, this tree against another commit, counted by callgrind.

Why instructions: on a shared machine the CPU seconds of ``bench/packet_path.py`` move by
10-20% with the load, more than the differences worth measuring; valgrind's callgrind
counts the instructions a run executes, which repeat exactly whatever else runs.  Each
figure is the difference of two runs that differ only in how many packets (or rounds)
they process, so start-up and imports cancel.

For each tree (this one and ``--base``, checked out in a temporary worktree):
- ``encode``: instructions to encode one 8 KiB reduce-scatter packet for one peer;
- ``decode``: to decode it one by one (the per-packet receive path);
- ``decode_batch``: to decode it in drains of 64 (the fast path);
- ``round``: per data packet of whole 4-node lossless rounds (250k float32, 8 KiB
  chunks), packets delivered one by one; ``drain``: the same delivered in drains of 32.

Needs ``valgrind`` and ``git``; about ten minutes per tree (each run is 30-60x slower
under callgrind).  Prints a table and one JSON line (``ratio_*``: this tree / base).
``--quick`` (what ``make bench`` runs) only checks that every workload runs in both
trees, without valgrind, in under a minute: it counts nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import bench_parser, emit_json

ROOT = Path(__file__).resolve().parent.parent

#: Run inside the tree under test: a workload of ``n`` packets (or rounds).
_WORKLOAD = r"""
import asyncio, sys, torch
sys.path.insert(0, "bench")
from gossipnet.config import Config
from gossipnet.collectives.lossy.kinds import LossyKind
from gossipnet.transport.wire import WireCodec
torch.set_num_threads(1)
mode, n = sys.argv[1], int(sys.argv[2])
if mode in ("round", "drain"):
    import importlib.util
    spec = importlib.util.spec_from_file_location("pp", "bench/packet_path.py")
    pp = importlib.util.module_from_spec(spec); spec.loader.exec_module(pp)
    r = asyncio.run(pp._rounds(250_000, 8192, n, 32 if mode == "drain" else 0))
    print("PACKETS", r["packets_per_round"] * n)
    raise SystemExit
cfg = Config(run="bench")
tx, rx = WireCodec(b"s", cfg, "a"), WireCodec(b"s", cfg, "b")
try:
    from gossipnet.testing import introduce
    introduce(tx, rx)
except ImportError:  # a tree before per-peer keys
    pass
payload = torch.randn(2048).numpy().tobytes()
fields = {"r": 7, "m": 0, "L": 123456789, "b": 0, "c": 5, "w": 1.0, "dt": "f32", "n": 2048}
pk = [[memoryview(f) for f in tx.encode(LossyKind.RS_DATA, fields, payload, dst="b")]
      for _ in range(n)]
if mode == "decode":
    for p in pk:
        rx.decode(p)
elif mode == "decode_batch":
    for i in range(0, n, 64):
        rx.decode_batch(pk[i:i + 64])
print("PACKETS", n)
"""

#: (mode, small n, large n): rounds for whole-round modes, packets for the codec.
_MODES = (("encode", 1000, 5000), ("decode", 1000, 5000), ("decode_batch", 1000, 5000),
          ("round", 1, 4), ("drain", 1, 4))  # fmt: skip


def _instructions(tree: Path, mode: str, n: int, *, count: bool = True) -> tuple[int, float]:
    """(instructions, packets) of one callgrind run of the workload in ``tree``
    (``count`` False: a plain run, instructions 0)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    grind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"] if count else []
    out = subprocess.run(
        [*grind, sys.executable, "-c", _WORKLOAD, mode, str(n)],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    text = out.stdout + out.stderr
    if not count:
        packets = next(line for line in text.splitlines() if line.startswith("PACKETS"))
        return 0, float(packets.split()[1])
    refs = next(line for line in text.splitlines() if "Collected" in line)
    packets = next(line for line in text.splitlines() if line.startswith("PACKETS"))
    return int(refs.split()[-1]), float(packets.split()[1])


def _per_packet(tree: Path) -> dict[str, float]:
    out = {}
    for mode, small, large in _MODES:
        i0, p0 = _instructions(tree, mode, small)
        i1, p1 = _instructions(tree, mode, large)
        out[mode] = (i1 - i0) / (p1 - p0)
    out["decode"] -= out["encode"]  # the decode workloads encode their packets first
    out["decode_batch"] -= out["encode"]
    return out


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--base", default="HEAD~1", help="the commit to compare with")
    args = parser.parse_args()
    if not args.quick and shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(base), args.base], check=True)  # fmt: skip
        try:
            if args.quick:
                for tree in (ROOT, base):
                    for mode, small, _ in _MODES:
                        _instructions(tree, mode, small, count=False)
                print("every workload ran in both trees (--quick counts nothing)")
                emit_json({"base": args.base, "quick": True})
                return
            ours, theirs = _per_packet(ROOT), _per_packet(base)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base)], check=False)  # fmt: skip
    print(f"{'per packet':>14} {'base':>10} {'this tree':>10} {'ratio':>7}")
    result: dict[str, object] = {"base": args.base}
    for mode in ours:
        ratio = ours[mode] / theirs[mode]
        print(f"{mode:>14} {theirs[mode]:>10.0f} {ours[mode]:>10.0f} {ratio:>7.3f}")
        result[f"{mode}_instructions"] = round(ours[mode])
        result[f"base_{mode}_instructions"] = round(theirs[mode])
        result[f"ratio_{mode}"] = round(ratio, 4)
    emit_json(result)


if __name__ == "__main__":
    main()
