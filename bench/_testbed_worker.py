"""The process that ``bench/testbed.py`` runs in each testbed host (not a bench itself).

One process per host lives through every phase of the bench: it joins gossipnet
(UDP) and a gloo process group (TCP) once, then, for each phase the
controller announces (a ``phase-<k>.json`` file, written after it set the
kernel loss and caps), times R back-to-back training steps and R all-reduces
on each backend and writes ``result-<k>-<rank>.json``.  Why long-lived: torch's
import costs seconds per process on two cores; eight phases of fresh workers
would spend the whole ``--quick`` budget starting up.

Why gloo ops are bounded by the group's own timeout: under 5-10% loss one gloo
collective can take many seconds (TCP retransmission timeouts, 200 ms and
doubling); a timed-out op is reported as ``>= timeout``, and since a gloo group
is unusable after a timeout, the controller asks for a fresh one next phase.
Plain dicts travel in and out (this module is loaded by file in the host).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

POLL_S = 0.01
GLOO_PORT = 29500
GN_PORT = 7000


def _wait_for(paths: list[Path], deadline_s: float) -> Path:
    end = time.monotonic() + deadline_s
    while True:
        for p in paths:
            if p.exists():
                return p
        if time.monotonic() > end:
            raise TimeoutError(f"none of {[p.name for p in paths]} within {deadline_s} s")
        time.sleep(POLL_S)


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (temporary name, then rename): readers poll."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


class _Bench:
    """Model, data and both backends of one rank."""

    def __init__(self, rank: int, plan: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        import gossipnet
        from gossipnet.testbed.train import batch_for, make_model, make_teacher

        torch.set_num_threads(1)
        self.torch, self.dist, self.rank, self.plan = torch, dist, rank, plan
        self.world = len(plan["ips"])
        self.teacher = make_teacher(0)
        self.batch_for = batch_for
        ips = plan["ips"]
        peers = [f"udp://{ip}:{GN_PORT}" for ip in ips]
        self.gn_model = make_model(plan["hidden"], 0)
        self.peer = gossipnet.join(
            peers=peers,
            listen=peers[rank],
            secret=b"bench-testbed",
            peer_id=f"h{rank}",
            chunk_bytes=plan["chunk_bytes"],
            wait_for=self.world,
            resync_every_steps=0,  # no resync spike inside a timed window
            collective_timeout_s=plan["gn_timeout_s"],
        )
        base = torch.optim.SGD(self.gn_model.parameters(), lr=0.01, momentum=0.9)
        self.gn_opt = self.peer.optimizer(base)
        self.timeout = timedelta(seconds=plan["gloo_timeout_s"])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{ips[0]}:{GLOO_PORT}",
            rank=rank,
            world_size=self.world,
            timeout=self.timeout,
        )
        self.group: Any = None
        self.gl_model = make_model(plan["hidden"], 0)
        self.gl_opt = torch.optim.SGD(self.gl_model.parameters(), lr=0.01, momentum=0.9)
        self.flat = torch.zeros(sum(p.numel() for p in self.gl_model.parameters()))
        self.step_no = 0

    def _grads(self, model: Any) -> None:
        model.zero_grad(set_to_none=True)  # a step cut short by a timeout left grads behind
        self.step_no += 1
        x, y = self.batch_for(self.teacher, 0, self.rank, self.step_no, 64)
        self.torch.nn.functional.cross_entropy(model(x), y).backward()

    # ------------------------------------------------------------------ gossipnet
    def gn_step(self) -> Any:
        self._grads(self.gn_model)
        report = self.gn_opt.step()
        self.gn_opt.zero_grad()
        return report

    def gn_allreduce(self) -> Any:
        return self.peer.all_reduce([self.flat], timeout=self.plan["gn_timeout_s"])

    def gossipnet(self, reps: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, op in (("step", self.gn_step), ("allreduce", self.gn_allreduce)):
            op()  # warm-up: phase deadlines re-learn the new conditions
            stale = total = lost = sent = 0
            t0 = time.perf_counter()
            for _ in range(reps):
                rep = op()
                stale += rep.chunks_stale
                total += rep.chunks_total
                lost += rep.packets_lost
                sent += rep.packets_received + rep.packets_lost
            out[name] = {
                "s": (time.perf_counter() - t0) / reps,
                "stale_frac": stale / total if total else 0.0,
                "delivered": 1.0 - lost / sent if sent else 1.0,
            }
        return out

    # ------------------------------------------------------------------ gloo
    def _gl_allreduce(self, t: Any) -> None:
        self.dist.all_reduce(t, group=self.group)
        t.div_(self.world)

    def gl_step(self) -> None:
        self._grads(self.gl_model)
        grads = [p.grad for p in self.gl_model.parameters() if p.grad is not None]
        flat = self.torch.cat([g.reshape(-1) for g in grads])
        self._gl_allreduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        self.gl_opt.step()
        self.gl_opt.zero_grad()

    def gloo(self, reps: int, new_group: bool, warmup: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            if new_group:
                self.group = self.dist.new_group(list(range(self.world)), timeout=self.timeout)
            if warmup:
                self._gl_allreduce(self.flat.clone())
        except Exception as err:  # the group could not even form in time
            fail = {"s": None, "error": repr(err)[:300], "done": 0}
            return {"step": fail, "allreduce": dict(fail)}
        ops = (("step", self.gl_step), ("allreduce", lambda: self._gl_allreduce(self.flat)))
        for name, op in ops:
            t0 = time.perf_counter()
            done = 0
            try:
                for _ in range(reps):
                    op()
                    done += 1
            except Exception as err:  # gloo timeout (or a peer's): the group is now broken
                out[name] = {
                    "s": None,
                    "error": repr(err)[:300],
                    "done": done,
                    "elapsed": time.perf_counter() - t0,
                }
                out.setdefault("allreduce", {"s": None, "error": "skipped", "done": 0})
                return out
            out[name] = {"s": (time.perf_counter() - t0) / reps, "done": done}
        return out


def bench_worker(rank: int, plan: dict[str, Any], ctrl_dir: str) -> dict[str, Any]:
    """Serve phases until ``stop`` appears; returns this rank's start-up seconds."""
    t0 = time.monotonic()
    ctrl = Path(ctrl_dir)
    bench = _Bench(rank, plan)
    ready = time.monotonic() - t0
    write_json(ctrl / f"ready-{rank}.json", {"rank": rank, "startup_s": ready})
    k = 0
    while True:
        found = _wait_for([ctrl / f"phase-{k}.json", ctrl / "stop"], plan["idle_timeout_s"])
        if found.name == "stop":
            break
        phase = json.loads(found.read_text())
        result: dict[str, Any] = {"rank": rank, "k": k}
        result["gossipnet"] = bench.gossipnet(phase["gn_reps"])
        result["gloo"] = bench.gloo(phase["gloo_reps"], phase["new_gloo_group"], k == 0)
        write_json(ctrl / f"result-{k}-{rank}.json", result)
        k += 1
    bench.peer.close()
    return {"rank": rank, "startup_s": ready, "phases": k}


if __name__ == "__main__":  # `make bench` runs bench/*.py: this helper does nothing alone
    pass
