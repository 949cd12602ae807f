"""The process that ``bench/testbed.py`` runs in each testbed host (not a bench itself).

One process per host lives through every phase of the bench: it joins gossipnet
(UDP) and a gloo process group (TCP) once, then, for each phase the
controller announces (a ``phase-<k>.json`` file, written after it set the
kernel loss and caps), times R back-to-back training steps and R all-reduces
on each backend and writes ``result-<k>-<rank>.json``.  Why long-lived: torch's
import costs seconds per process on two cores; eight phases of fresh workers
would spend the whole ``--quick`` budget starting up.

Every op is timed on its own (a list of seconds per rep), so the controller
can take, per rep, the slowest host (a collective ends when its last member
does) and then the median over reps: one TCP retransmission timeout more or
less in a rep moves a mean a lot and a median little.

Why gossipnet is re-joined when the phase's pacing changes: the UDP socket
reads ``Config.udp_pace_mbps`` when it starts; capped phases pace at the
cap (the link's rate, as a user would set it), uncapped ones do not pace.
Each incarnation listens on its own port so no packet of the old one is
mistaken for the new.

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


def _loop_profiler(peer: Any, path: str) -> Any:
    """cProfile ``peer``'s event-loop thread (its own CPU time) until the returned
    callable stops it and writes ``path``: where a row's per-packet CPU goes."""
    import cProfile
    import threading

    prof = cProfile.Profile(time.thread_time)
    loop = peer.runtime.loop_thread.loop
    started, stopped = threading.Event(), threading.Event()
    loop.call_soon_threadsafe(lambda: (prof.enable(), started.set()))
    started.wait(5.0)

    def stop() -> None:
        loop.call_soon_threadsafe(lambda: (prof.disable(), stopped.set()))
        stopped.wait(5.0)
        prof.dump_stats(path)

    return stop


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
        self.gossipnet_mod = gossipnet
        self.gn_model = make_model(plan["hidden"], 0)
        self.pace: float | None = None
        self.incarnation = 0
        self._join_gossipnet()
        self.timeout = timedelta(seconds=plan["gloo_timeout_s"])
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{plan['ips'][0]}:{GLOO_PORT}",
            rank=rank,
            world_size=self.world,
            timeout=self.timeout,
        )
        self.group: Any = None
        self.gl_model = make_model(plan["hidden"], 0)
        self.gl_opt = torch.optim.SGD(self.gl_model.parameters(), lr=0.01, momentum=0.9)
        self.flat = torch.zeros(sum(p.numel() for p in self.gl_model.parameters()))
        self.step_no = 0

    def _join_gossipnet(self) -> None:
        ips = self.plan["ips"]
        port = GN_PORT + self.incarnation
        peers = [f"udp://{ip}:{port}" for ip in ips]
        self.peer = self.gossipnet_mod.join(
            peers=peers,
            listen=peers[self.rank],
            secret=b"bench-testbed",
            peer_id=f"h{self.rank}",
            chunk_bytes=self.plan["chunk_bytes"],
            wait_for=self.world,
            resync_every_steps=0,  # no resync spike inside a timed window
            collective_timeout_s=self.plan["gn_timeout_s"],
            udp_pace_mbps=self.pace,
        )
        base = self.torch.optim.SGD(self.gn_model.parameters(), lr=0.01, momentum=0.9)
        self.gn_opt = self.peer.optimizer(base)

    def set_pace(self, mbps: float | None) -> None:
        """Re-join gossipnet with UDP pacing at ``mbps`` (None: unpaced) if it changed."""
        if mbps == self.pace:
            return
        self.peer.close()
        self.pace = mbps
        self.incarnation += 1
        self._join_gossipnet()

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

    def gossipnet(self, reps: int, phase: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {}
        profile_dir = self.plan.get("profile_dir")
        for name, op in (("step", self.gn_step), ("allreduce", self.gn_allreduce)):
            op()  # warm-up: phase deadlines re-learn the new conditions
            stop = None
            if profile_dir:
                where = f"{profile_dir}/{name}-{self.rank}-{phase}.prof"
                stop = _loop_profiler(self.peer, where)
            stale = total = lost = sent = 0
            loop_cpu = caller_cpu = 0.0
            times = []
            loop_reps = []
            cpu0 = time.process_time()
            for _ in range(reps):
                t0 = time.perf_counter()
                rep = op()
                times.append(time.perf_counter() - t0)
                stale += rep.chunks_stale
                total += rep.chunks_total
                lost += rep.packets_lost
                sent += rep.packets_received + rep.packets_lost
                loop_cpu += rep.extra.get("cpu_s", float("nan"))  # NaN: a gossipnet before #21
                loop_reps.append(round(rep.extra.get("cpu_s", float("nan")), 4))
                caller_cpu += rep.extra.get("cpu_caller_s", float("nan"))
            if stop is not None:
                stop()
            out[name] = {
                "times": times,
                "cpu_s": (time.process_time() - cpu0) / reps,
                "stale_frac": stale / total if total else 0.0,
                "delivered": 1.0 - lost / sent if sent else 1.0,
                "loop_cpu_s": loop_cpu / reps,  # the reports' own figures
                "loop_cpu_reps": loop_reps,  # per rep: where a transient shows
                "caller_cpu_s": caller_cpu / reps,
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
            fail = {"times": None, "error": repr(err)[:300], "done": 0}
            return {"step": fail, "allreduce": dict(fail)}
        ops = (("step", self.gl_step), ("allreduce", lambda: self._gl_allreduce(self.flat)))
        for name, op in ops:
            t0 = time.perf_counter()
            cpu0 = time.process_time()
            done = 0
            times = []
            try:
                for _ in range(reps):
                    t1 = time.perf_counter()
                    op()
                    times.append(time.perf_counter() - t1)
                    done += 1
            except Exception as err:  # gloo timeout (or a peer's): the group is now broken
                out[name] = {
                    "times": None,
                    "error": repr(err)[:300],
                    "done": done,
                    "elapsed": time.perf_counter() - t0,
                }
                out.setdefault("allreduce", {"times": None, "error": "skipped", "done": 0})
                return out
            out[name] = {"times": times, "done": done, "cpu_s": (time.process_time() - cpu0) / reps}
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
        bench.set_pace(phase.get("gn_pace_mbps"))
        result["gossipnet"] = bench.gossipnet(phase["gn_reps"], k)
        result["gloo"] = bench.gloo(phase["gloo_reps"], phase["new_gloo_group"], k == 0)
        write_json(ctrl / f"result-{k}-{rank}.json", result)
        k += 1
    bench.peer.close()
    return {"rank": rank, "startup_s": ready, "phases": k}


if __name__ == "__main__":  # `make bench` runs bench/*.py: this helper does nothing alone
    pass
