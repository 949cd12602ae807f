"""Issue 19, part 3: local users cannot hijack a peer through shared directories.

The testbed's run directory, Blink islands' shared-memory files and the
same-host socket directory are files another local user can race for.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import stat
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from gossipnet.collectives.island import share as _island_share
from gossipnet.collectives.island.share import SharedBuckets, load_handles, open_handles
from gossipnet.testbed import _runner
from gossipnet.testbed._net import Testbed
from gossipnet.transport.zeromq import local_ipc as _local_ipc

LAYOUT = [(10, torch.float32)]


# ---------------------------------------------------------------------- testbed
def test_testbed_run_dir_is_private_even_when_its_old_name_was_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``<tmp>/gntb<pid>x<n>-run`` was predictable and accepted when another user
    had created it (mode 0777, files of theirs in it): now it is a fresh mkdtemp."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tb = Testbed()
    squatted = tmp_path / f"{tb.name}-run"
    squatted.mkdir()
    squatted.chmod(0o777)
    run_dir = tb.run_dir
    assert run_dir != squatted
    assert run_dir.parent == tmp_path
    assert run_dir.name.startswith(f"{tb.name}-run")
    st = run_dir.lstat()
    assert stat.S_ISDIR(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()
    run_dir.rmdir()


class _Planted:
    """What an attacker writes as a spec file: unpickling it runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(self.marker),))  # type: ignore[return-value]


def test_testbed_runner_loads_no_pickle(tmp_path: Path) -> None:
    """Root's runner loaded pickles from the run directory: a planted one ran code."""
    marker = tmp_path / "ran-as-root"
    spec, result = tmp_path / "spec", tmp_path / "result"
    spec.write_bytes(pickle.dumps(_Planted(marker)))
    assert _runner.main(["runner", str(spec), str(result)]) == 1
    assert not marker.exists()
    assert json.loads(result.read_text())["status"] == "error"


def test_testbed_call_specs_and_results_travel_as_json(tmp_path: Path) -> None:
    spec, result = tmp_path / "spec.json", tmp_path / "result.json"
    call = {
        "module": "builtins", "qualname": "divmod", "file": None, "standalone": False,
        "sys_path": list(sys.path), "args": _runner.to_json([7, 2]), "kwargs": {},
    }  # fmt: skip
    spec.write_text(json.dumps(call))
    assert _runner.main(["runner", str(spec), str(result)]) == 0
    out = json.loads(result.read_text())
    assert _runner.from_json(out["value"]) == (3, 1)
    value = {"t": (1, b"\x00", [2.5, None]), "ok": True}
    assert _runner.from_json(json.loads(json.dumps(_runner.to_json(value)))) == value
    with pytest.raises(TypeError, match="cannot cross"):
        _runner.to_json(object())


# ---------------------------------------------------------------------- blink shm
@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(_island_share, "_SHM_DIR", str(tmp_path))
    return tmp_path


def _name() -> str:
    return f"gossipnet-{os.getpid()}-{'ab' * 6}"


def test_shm_handle_to_a_symlink_is_refused_and_its_target_untouched(shm: Path) -> None:
    """A handle naming a symlink to another file was mapped and written to."""
    victim = shm / "victim"
    victim.write_bytes(bytes(40))
    (shm / _name()).symlink_to(victim)
    with pytest.raises(ValueError, match="cannot be opened"):
        open_handles([("file", str(shm / _name()), 10, "f32")], LAYOUT)
    assert victim.read_bytes() == bytes(40)


@pytest.mark.parametrize(
    "path",
    [
        "{shm}/../{name}",  # traversal out of the directory
        "{shm}/sub/{name}",
        "{shm}/victim",  # not a bucket name
        "/etc/{name}",
    ],
)
def test_shm_handle_outside_the_directory_is_refused(shm: Path, path: str) -> None:
    with pytest.raises(ValueError, match="not a gossipnet file"):
        open_handles([("file", path.format(shm=shm, name=_name()), 10, "f32")], LAYOUT)


def test_shm_handle_of_a_file_others_can_write_is_refused(shm: Path) -> None:
    f = shm / _name()
    f.write_bytes(bytes(40))
    f.chmod(0o666)
    with pytest.raises(ValueError, match="mode 666"):
        open_handles([("file", str(f), 10, "f32")], LAYOUT)
    f.chmod(0o600)
    f.write_bytes(bytes(8))
    with pytest.raises(ValueError, match="8 B"):
        open_handles([("file", str(f), 10, "f32")], LAYOUT)


def test_shm_handles_of_our_own_buckets_still_map(shm: Path) -> None:
    buckets = SharedBuckets(LAYOUT, torch.device("cpu"))
    (mapped,) = open_handles(load_handles(buckets.handles()), LAYOUT)
    mapped.fill_(3.0)
    assert buckets.buckets[0].tolist() == [3.0] * 10


# ---------------------------------------------------------------------- local ipc
def test_a_foreign_socket_directory_is_a_warning_that_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A pre-created ``<tmp>/gossipnet-<uid>`` silently turned the same-host path off."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(_local_ipc, "_warned", set(), raising=False)
    taken = tmp_path / f"gossipnet-{os.getuid()}"
    taken.mkdir()
    taken.chmod(0o777)  # as another user's would be to us: not private
    with caplog.at_level(logging.WARNING, logger="gossipnet.transport.zeromq.local_ipc"):
        assert _local_ipc.alias_path(7000) is None
        assert _local_ipc.alias_path(7001) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once, not per dial
    assert str(taken) in warnings[0].getMessage()
    assert "TMPDIR" in warnings[0].getMessage()
