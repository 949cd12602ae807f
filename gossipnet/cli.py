"""The ``gossipnet`` console script: ``demo``, ``bench`` (``testbed`` plugs in later).

Why a CLI at all: the first thing a newcomer wants is to *see* training survive
packet loss, without writing a launcher: ``gossipnet demo --loss 0.1`` spawns N
local peers that train a small language model over lossy loopback TCP, shows
a live line, and leaves a CSV and a loss plot behind.

Subcommands live in :data:`COMMANDS`; another module adds one with
:func:`register_command` (this is the hook for ``gossipnet testbed``), and
:func:`main` builds the parser from the registry.  This module is the only
place in the package that prints: it is user-facing output.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

__all__ = ("COMMANDS", "Command", "main", "register_command")


class Command(NamedTuple):
    """One subcommand: its one-line help, how it adds its options, what it runs."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: Subcommand registry, name -> :class:`Command`, in ``--help`` order.
COMMANDS: dict[str, Command] = {}


def register_command(
    name: str,
    help: str,
    configure: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """Add (or replace) subcommand ``name``; ``run(args)`` returns the exit status."""
    COMMANDS[name] = Command(help, configure, run)


# ---------------------------------------------------------------------- demo
def _configure_demo(p: argparse.ArgumentParser) -> None:
    from gossipnet.demo.harness import SPLITS, DemoConfig

    d = DemoConfig()
    p.add_argument("--peers", type=int, default=d.peers, help="local peer processes")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps")
    p.add_argument("--loss", type=float, default=0.1, help="packet loss rate (0.1 = 10%%)")
    p.add_argument(
        "--burst",
        type=float,
        default=None,
        metavar="PACKETS",
        help="bursty (Gilbert-Elliott) loss with this mean burst length; mean rate --loss",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="fault plan seed")
    p.add_argument("--data-seed", type=int, default=d.data_seed, help="batch sampling seed")
    p.add_argument(
        "--strategy",
        choices=("allreduce", "grads"),
        default=d.strategy,
        help="allreduce: net.optimizer (sharded step + parameter broadcast); "
        "grads: net.all_reduce(gradients) then a local step",
    )
    p.add_argument(
        "--split",
        choices=SPLITS,
        default=d.split,
        help="shuffled: every peer gets random blocks of the whole text (IID, as "
        "DistributedSampler); contiguous: one slice of the files each (non-IID)",
    )
    p.add_argument("--batch", type=int, default=d.batch, help="windows per peer per step")
    p.add_argument("--context", type=int, default=d.context, help="characters per window")
    p.add_argument("--d-model", type=int, default=d.d_model, help="transformer width")
    p.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between evals")
    p.add_argument(
        "--chunk-bytes", type=int, default=d.chunk_bytes, help="payload bytes per data packet"
    )
    p.add_argument(
        "--redundancy",
        type=int,
        default=d.redundancy,
        metavar="K",
        help="send every data packet K times (loss p becomes ~p^K, K x the traffic)",
    )
    p.add_argument(
        "--parity",
        type=int,
        default=d.parity_group,
        metavar="K",
        help="one XOR parity packet per K data packets: rebuilds one lost of K, 1/K more"
        " traffic (default: the library's, 4 in the optimizer's rounds; 0: none)",
    )
    p.add_argument(
        "--no-stale-step",
        action="store_true",
        help="lost parameter broadcasts keep their values (no estimated step)",
    )
    p.add_argument("--compare", action="store_true", help="run lossless first, plot both")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")


def _demo_config(args: argparse.Namespace) -> Any:
    from gossipnet.demo.harness import DemoConfig

    return DemoConfig(
        peers=args.peers,
        steps=args.steps,
        loss=args.loss,
        burst=args.burst,
        redundancy=args.redundancy,
        parity_group=args.parity,
        stale_step=not args.no_stale_step,
        seed=args.seed,
        data_seed=args.data_seed,
        strategy=args.strategy,
        split=args.split,
        batch=args.batch,
        context=args.context,
        d_model=args.d_model,
        layers=args.layers,
        lr=args.lr,
        eval_every=args.eval_every,
        chunk_bytes=args.chunk_bytes,
    )


class _Progress:
    """A live status line: rewritten with ``\\r`` on a TTY, every 10% otherwise.

    Why not tqdm: it is not a dependency; a plain line does the job and keeps
    logs readable when stdout is a file (CI).
    """

    def __init__(self, label: str, steps: int, peers: int, stream: TextIO | None = None) -> None:
        self.label, self.steps, self.peers = label, steps, peers
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = 0.0
        self.active = False  # a line is showing that close() must end
        self.lost = self.expected = 0
        self.smooth: float | None = None
        self.next_report = 0

    def __call__(self, rec: Any) -> None:
        if not self.t0:
            self.t0 = time.monotonic()
        self.active = True
        self.lost += rec.packets_lost
        self.expected += rec.packets_lost + rec.packets_received
        self.smooth = rec.train_loss if self.smooth is None else (
            0.9 * self.smooth + 0.1 * rec.train_loss
        )  # fmt: skip
        if rec.rank != 0:
            return
        pct = 100.0 * self.lost / self.expected if self.expected else 0.0
        line = (
            f"[{self.label}] step {rec.step:>4}/{self.steps}  loss {self.smooth:.3f}  "
            f"lost {pct:4.1f}%  contributors {rec.contributors}/{self.peers}  "
            f"{time.monotonic() - self.t0:5.1f} s"
        )
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif rec.step >= self.next_report or rec.step == self.steps:
            self.stream.write(line + "\n")
            self.next_report = rec.step + max(1, self.steps // 10)

    def close(self) -> None:
        if self.tty and self.active:
            self.stream.write("\n")
        self.active = False


def _write_csv(path: Path, runs: Sequence[Any]) -> None:
    """One row per (run, peer, step); ``eval_loss`` is filled where that peer evaluated."""
    from gossipnet.demo.harness import StepRecord

    cols = [f.name for f in dataclasses.fields(StepRecord)]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run", *cols, "eval_loss"])
        for res in runs:
            evals = {(e.rank, e.step): e.eval_loss for e in res.evals}
            for rec in sorted(res.steps, key=lambda r: (r.step, r.rank)):
                row = dataclasses.astuple(rec)
                ev = evals.get((rec.rank, rec.step))
                w.writerow([res.config.label(), *row, "" if ev is None else f"{ev:.5f}"])


def _mean_by_step(res: Any, value: Callable[[Any], float]) -> tuple[list[int], list[float]]:
    by: dict[int, list[float]] = {}
    for r in res.steps:
        by.setdefault(r.step, []).append(value(r))
    steps = sorted(by)
    return steps, [sum(by[s]) / len(by[s]) for s in steps]


def _plot(path: Path, runs: Sequence[Any]) -> bool:
    """Loss curves (train, smoothed; eval, markers) and per-step loss rate; False
    when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    for i, res in enumerate(runs):
        color = f"C{i}"
        steps, train = _mean_by_step(res, lambda r: r.train_loss)
        h = max(1, len(train) // 60)  # centred moving average: per-step loss is noisy
        windows = [train[max(0, j - h) : j + h + 1] for j in range(len(train))]
        smooth = [sum(w) / len(w) for w in windows]
        ax.plot(steps, train, color=color, alpha=0.2, lw=0.8)
        ax.plot(steps, smooth, color=color, lw=1.5, label=f"{res.config.label()} train")
        curve = res.eval_curve()
        ax.plot([s for s, _ in curve], [v for _, v in curve], "o--", color=color,
                label=f"{res.config.label()} eval (ppl {res.final_ppl:.2f})")  # fmt: skip
        _, lost = _mean_by_step(
            res, lambda r: 100.0 * r.packets_lost / max(1, r.packets_lost + r.packets_received)
        )
        ax2.plot(steps, lost, color=color, lw=0.8)
    ax.set_ylabel("loss (nats / char)")
    ax.set_title(f"gossipnet demo: {runs[0].config.peers} peers, char-level transformer LM")
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.set_xlabel("step")
    ax2.set_ylabel("packets lost %")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _run_demo(args: argparse.Namespace) -> int:
    from gossipnet.demo.harness import run_demos

    try:
        lossy = _demo_config(args)
    except ValueError as err:
        print(f"gossipnet demo: {err}", file=sys.stderr)
        return 2
    configs = [lossy]
    if args.compare:  # both runs on one set of processes: half the start-up
        configs.insert(
            0, dataclasses.replace(lossy, loss=0.0, burst=None, redundancy=1, parity_group=None)
        )
    bars = [_Progress(c.label(), c.steps, c.peers) for c in configs]

    def on_step(run: int, rec: Any) -> None:
        if run and bars[run - 1].active:
            bars[run - 1].close()
        bars[run](rec)

    try:
        runs = run_demos(configs, None if args.no_progress else on_step)
    except RuntimeError as err:
        print(f"\ngossipnet demo: {err}", file=sys.stderr)
        return 1
    finally:
        for bar in bars:
            bar.close()
    for res in runs:
        lo, hi = res.final_spread
        print(
            f"{res.config.label()}: final eval loss {res.final_eval_loss:.4f} nats/char "
            f"(replicas min {lo:.4f}, max {hi:.4f}), "
            f"perplexity {res.final_ppl:.3f}, packets lost {100 * res.lost_fraction:.1f}%, "
            f"{res.wall_s:.1f} s ({res.startup_s:.1f} s start-up)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = args.out / "steps.csv", args.out / "loss.png"
    _write_csv(csv_path, runs)
    print(f"per-step records: {csv_path}")
    if _plot(png_path, runs):
        print(f"loss plot:        {png_path}")
    else:
        print("loss plot:        skipped (matplotlib is not installed: pip install matplotlib)")
    if len(runs) == 2:
        rel = runs[1].final_ppl / runs[0].final_ppl - 1.0
        print(f"perplexity {runs[1].config.label()} vs lossless: {100 * rel:+.2f}%")
    bad = [(res.config.label(), why) for res in runs if (why := res.disagreement())]
    for label, why in bad:
        print(f"gossipnet demo: {label}: {why}: the replicas are not one model", file=sys.stderr)
    return 3 if bad else 0


# ---------------------------------------------------------------------- bench
def _bench_dir() -> Path | None:
    """``bench/`` of a source checkout: next to the package, else under the cwd."""
    for base in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (base / "bench").is_dir():
            return base / "bench"
    return None


def _configure_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", help="bench scripts to run (default: all)")
    p.add_argument("--full", action="store_true", help="full presets instead of --quick")
    p.add_argument("--verbose", action="store_true", help="show each bench's whole output")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per bench")


def _run_bench(args: argparse.Namespace) -> int:
    bench = _bench_dir()
    if bench is None:
        print("gossipnet bench: no bench/ folder found (run it from a source checkout)")
        return 2
    scripts = sorted(p for p in bench.glob("*.py") if not p.name.startswith("_"))
    if args.names:
        wanted = {n.removesuffix(".py") for n in args.names}
        scripts = [s for s in scripts if s.stem in wanted]
        missing = wanted - {s.stem for s in scripts}
        if missing:
            print(f"gossipnet bench: no such bench: {sorted(missing)}", file=sys.stderr)
            return 2
    status = 0
    for script in scripts:
        cmd = [sys.executable, str(script), *([] if args.full else ["--quick"])]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=bench.parent, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            print(f"# {script.name}: timed out after {args.timeout:.0f} s")
            status = 1
            continue
        if args.verbose:
            print(proc.stdout + proc.stderr, end="")
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        last = lines[-1] if lines else ""
        print(f"# {script.name}: exit {proc.returncode}, {time.monotonic() - t0:.1f} s")
        try:
            json.loads(last)
            print(last)
        except json.JSONDecodeError:
            status = 1
            print(f"(no JSON last line; stderr tail: {proc.stderr.strip()[-500:]!r})")
        status = status or (1 if proc.returncode else 0)
    return status


register_command("demo", "N local peers train a small LM under packet loss", _configure_demo,
                 _run_demo)  # fmt: skip
register_command("bench", "run bench/*.py (--quick) and print their JSON lines",
                 _configure_bench, _run_bench)  # fmt: skip


def _register_testbed() -> None:
    # imported here, not at the top: the testbed package needs nothing until used,
    # but keeps its own parser next to the code it drives
    from gossipnet.testbed import cli as testbed_cli

    register_command("testbed", testbed_cli.HELP, testbed_cli.configure, testbed_cli.main)


_register_testbed()


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default once, and descriptions as written.

    Why not plain ``ArgumentDefaultsHelpFormatter``: it appends "(default: ...)" even
    where the help already says what the default means (a doubled default), and
    "(default: False)" to every flag; descriptions keep their line breaks (examples).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "(default" in text or default is None or default is False or default == []:
            return action.help
        return super()._get_help_string(action)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gossipnet`` console script; returns the exit status."""
    from gossipnet import __version__

    parser = argparse.ArgumentParser(
        prog="gossipnet", description="data-parallel PyTorch training over lossy networks"
    )
    parser.add_argument("--version", action="version", version=f"gossipnet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        cmd.configure(
            sub.add_parser(
                name, help=cmd.help, description=cmd.help, formatter_class=_HelpFormatter
            )
        )
    args = parser.parse_args(argv)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
