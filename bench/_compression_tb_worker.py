"""The process ``bench/_compression_testbed.py`` runs in each testbed host (not a bench).

One process per host for the whole run (torch's import costs seconds per
process on two shared cores).  It joins a gloo process group once and
gossipnet (UDP) once per pacing rate, then serves jobs: the controller writes
``job-<k>.json`` (method, cap, step and time caps) after it set the links, and
every rank trains the same fresh model (same seed, same batches per rank and
step) with that method until the target loss, the step cap or the time cap.

Why evaluation goes through files, not the network: the ranks must agree on
when to stop (a rank that stops early hangs the others' collectives), and a
decision carried over the measured links would itself be delayed by the loss
being measured.  Every ``eval_every`` steps each rank stops its clock, writes
its own evaluation loss and training seconds, waits for the other ranks'
files and applies the same rule to the same numbers; the wait is off the
clock.  Methods, each followed by the plan's optimizer step (``optim``: Adam, or
SGD with momentum; :func:`make_optimizer`), the same for all:

  gn_<compressor>   ``net.all_reduce(grads, compress=...)`` (UDP, paced at the cap;
                    ArcTopK and DCT send values in the plan's ``values`` codec)
  gloo              ``dist.all_reduce`` of the flat gradient, / world (TCP)
  powersgd<r>       DDP over gloo with PyTorch's PowerSGD hook, rank r

Bytes on the wire: this host's ``eth0`` transmit counter (``/proc/net/dev``
read inside the namespace) over the job, so every method is counted the same
way (gossipnet's own ``bytes_sent`` is reported beside it).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

POLL_S = 0.005
GLOO_PORT = 29600
GN_PORT = 7100


def parse_net_dev(text: str) -> dict[str, tuple[int, int]]:
    """``/proc/net/dev`` as ``{interface: (rx_bytes, tx_bytes)}``.

    The first two lines are headers; each other line is ``name: rx_bytes
    rx_packets ... (8 receive fields) tx_bytes ...``.  A malformed line raises
    ``ValueError`` naming it (a wrong byte count must not pass silently).
    """
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines()[2:]:
        if not line.strip():
            continue
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if not sep or len(fields) < 9:
            raise ValueError(f"unexpected /proc/net/dev line: {line!r}")
        out[name.strip()] = (int(fields[0]), int(fields[8]))
    return out


def _tx_bytes(iface: str = "eth0") -> int:
    return parse_net_dev(Path("/proc/net/dev").read_text())[iface][1]


def make_optimizer(params: Any, optim: dict[str, Any]) -> Any:
    """The optimizer of ``optim`` (``{"name": "adam"|"sgd", "lr", "momentum"}``)."""
    import torch

    if optim["name"] == "adam":
        return torch.optim.Adam(params, lr=optim["lr"])
    if optim["name"] == "sgd":
        return torch.optim.SGD(params, lr=optim["lr"], momentum=optim["momentum"])
    raise ValueError(f"unknown optimizer {optim['name']!r}")


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (readers poll for the name)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _wait_json(paths: list[Path], deadline_s: float) -> list[Any]:
    end = time.monotonic() + deadline_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > end:
            raise TimeoutError(f"missing {[p.name for p in paths if not p.exists()]}")
        time.sleep(POLL_S)
    return [json.loads(p.read_text()) for p in paths]


class _Host:
    """Both backends of one rank, and the training loop every method shares."""

    def __init__(self, rank: int, plan: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        import gossipnet
        from gossipnet.testbed import train

        torch.set_num_threads(1)
        self.torch, self.dist, self.gn, self.train = torch, dist, gossipnet, train
        self.rank, self.plan = rank, plan
        self.world = len(plan["ips"])
        self.teacher = train.make_teacher(plan["seed"])
        self.timeout = timedelta(seconds=plan["gloo_timeout_s"])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{plan['ips'][0]}:{GLOO_PORT}",
            rank=rank,
            world_size=self.world,
            timeout=self.timeout,
        )
        self.group: Any = None  # None: the default group; a fresh one after a failure
        self.peer: Any = None
        self.pace: float | None = -1.0
        self.incarnation = 0

    # ------------------------------------------------------------------ backends
    def _join(self, pace: float | None) -> None:
        """(Re-)join gossipnet when the pacing rate changes (the socket reads it once)."""
        if pace == self.pace:
            return
        if self.peer is not None:
            self.peer.close()
        self.pace, self.incarnation = pace, self.incarnation + 1
        peers = [f"udp://{ip}:{GN_PORT + self.incarnation}" for ip in self.plan["ips"]]
        self.peer = self.gn.join(
            peers=peers,
            listen=peers[self.rank],
            secret=b"bench-compression-testbed",
            peer_id=f"h{self.rank}",
            chunk_bytes=self.plan["chunk_bytes"],
            wait_for=self.world,
            resync_every_steps=0,
            collective_timeout_s=self.plan["gn_timeout_s"],
            udp_pace_mbps=pace,
            compressed_copies=self.plan.get("copies", 1),
        )

    def _compressor(self, method: str) -> Any:
        d, values = self.plan["density"], self.plan["values"]
        if method == "gn_arctopk":
            return self.gn.ArcTopK(density=d, values=values)
        if method == "gn_dct":
            return self.gn.DCT(density=d, refresh_every=50, values=values)
        if method == "gn_dense":
            return None
        raise ValueError(f"unknown method {method!r}")

    def _reducer(self, method: str, model: Any, job: dict[str, Any]) -> tuple[Any, Any]:
        """(model to call, function of the optimizer that averages the gradients after
        backward and steps it)."""
        params = list(model.parameters())
        if method.startswith("gn_"):
            self._join(job["pace_mbps"])
            spec = self._compressor(method)
            stats: dict[str, float] = {"bytes_sent": 0.0, "rounds": 0.0}

            def gn_reduce(opt: Any) -> None:
                # step=opt: with Adam, the catch-up step on the sparse sums
                rep = self.peer.all_reduce([p.grad for p in params], compress=spec, step=opt)
                stats["bytes_sent"] += rep.extra.get("bytes_sent", 0.0)
                stats["rounds"] += 1

            gn_reduce.stats = stats  # type: ignore[attr-defined]
            return model, gn_reduce
        if method == "gloo":

            def gloo_reduce(opt: Any) -> None:
                flat = self.torch.cat([p.grad.reshape(-1) for p in params])
                self.dist.all_reduce(flat, group=self.group)
                flat.div_(self.world)
                off = 0
                for p in params:
                    p.grad.copy_(flat[off : off + p.numel()].view_as(p.grad))
                    off += p.numel()
                opt.step()

            return model, gloo_reduce
        if method.startswith("powersgd"):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            from torch.nn.parallel import DistributedDataParallel as DDP

            # One bucket: with DDP's default small first bucket, two buckets' hook chains
            # issue gloo ops from different threads in different orders on different
            # ranks (PowerSGD's callbacks start the P and Q all-reduces), and gloo then
            # deadlocks or fails with a size mismatch (seen with torch 2.13 here).
            ddp = DDP(model, process_group=self.group, bucket_cap_mb=64)
            state = ps.PowerSGDState(
                process_group=self.group,
                matrix_approximation_rank=int(method.removeprefix("powersgd") or 1),
                start_powerSGD_iter=2,  # the smallest the hook allows with error feedback
                random_seed=self.plan["seed"],
            )
            ddp.register_comm_hook(state, ps.powerSGD_hook)
            return ddp, lambda opt: opt.step()  # DDP averages inside backward
        raise ValueError(f"unknown method {method!r}")

    # ------------------------------------------------------------------ one job
    def run_job(self, k: int, job: dict[str, Any], ctrl: Path) -> dict[str, Any]:
        torch, seed = self.torch, self.plan["seed"]
        model = self.train.make_model(self.plan["hidden"], seed)
        net, reduce = self._reducer(job["method"], model, job)
        opt = make_optimizer(model.parameters(), self.plan["optim"])
        segments: list[list[float]] = []  # [step, seconds, cpu seconds, eval loss]
        tx0, train_s, step = _tx_bytes(), 0.0, 0
        while True:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(job["eval_every"]):
                step += 1
                opt.zero_grad(set_to_none=False)
                x, y = self.train.batch_for(self.teacher, seed, self.rank, step, self.plan["batch"])
                torch.nn.functional.cross_entropy(net(x), y).backward()
                reduce(opt)  # averages the gradients and steps opt
            seg = time.perf_counter() - t0
            cpu = time.process_time() - c0
            train_s += seg
            loss = self.train.eval_loss(model, self.teacher, seed)
            segments.append([step, seg, cpu, loss])
            write_json(ctrl / f"ev-{k}-{step}-{self.rank}.json", {"loss": loss, "s": train_s})
            paths = [ctrl / f"ev-{k}-{step}-{r}.json" for r in range(self.world)]
            evals = _wait_json(paths, self.plan["gloo_timeout_s"] * 3 + 60)
            if should_stop(evals, step, job["target"], job["max_steps"], job["max_s"]):
                break
        out = {"rank": self.rank, "segments": segments, "tx_bytes": _tx_bytes() - tx0}
        if hasattr(reduce, "stats"):
            out["gn_bytes_sent"] = reduce.stats["bytes_sent"]
        return out


def should_stop(
    evals: list[dict[str, float]], step: int, target: float, max_steps: int, max_s: float
) -> bool:
    """Every rank's rule on every rank's numbers: mean loss at target, or a cap hit.

    The time cap uses the slowest rank's training seconds, so all ranks decide alike.
    """
    mean = sum(e["loss"] for e in evals) / len(evals)
    return mean <= target or step >= max_steps or max(e["s"] for e in evals) >= max_s


def tb_worker(rank: int, plan: dict[str, Any], ctrl_dir: str) -> dict[str, Any]:
    """Serve jobs until ``stop`` appears; a failed job is reported, not fatal."""
    ctrl = Path(ctrl_dir)
    t0 = time.monotonic()
    host = _Host(rank, plan)
    write_json(ctrl / f"ready-{rank}.json", {"startup_s": time.monotonic() - t0})
    k = 0
    while True:
        job_path, stop = ctrl / f"job-{k}.json", ctrl / "stop"
        while not (job_path.exists() or stop.exists()):
            time.sleep(POLL_S)
        if stop.exists() and not job_path.exists():
            break
        job = json.loads(job_path.read_text())
        try:
            result = host.run_job(k, job, ctrl)
        except Exception as err:  # a gloo timeout: report it, use a fresh group next job
            result = {"rank": rank, "error": repr(err)[:400]}
            host.group = host.dist.new_group(list(range(host.world)), timeout=host.timeout)
        write_json(ctrl / f"result-{k}-{rank}.json", result)
        k += 1
    if host.peer is not None:
        host.peer.close()
    return {"rank": rank, "jobs": k}


if __name__ == "__main__":  # `make bench` runs bench/*.py: this helper does nothing alone
    pass
