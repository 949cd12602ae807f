"""``gossipnet.runtime._malloc``: glibc malloc settings, applied once, never over the user's."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
from gossipnet.runtime import _malloc
first = _malloc.tune_malloc()
print(first, _malloc.tune_malloc() == first)
"""


def run(env_extra: dict[str, str]) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=90
    )  # an import of gossipnet (torch): ~1.4 s on 2 idle cores, ~18 s at a load of 12
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.timeout(3 * 90 + 10)  # three subprocesses, each bounded above
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_applied_once_on_glibc_and_never_over_the_users_choice() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        pytest.skip("not glibc")
    assert run({}) == "True True"  # in force, and a second call changes nothing
    assert run({"MALLOC_TRIM_THRESHOLD_": "131072"}) == "False True"
    assert run({"MALLOC_MMAP_THRESHOLD_": "131072"}) == "False True"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tune", [True, False])
def test_join_tunes_malloc_only_when_config_says_so(
    tune: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gossipnet
    from gossipnet.runtime import runtime as _runtime

    calls: list[bool] = []
    monkeypatch.setattr(_runtime, "tune_malloc", lambda: calls.append(True) or True)
    peer = gossipnet.join(peers=[], listen="tcp://127.0.0.1:0", tune_malloc=tune)
    try:
        assert calls == ([True] if tune else [])
    finally:
        peer.leave()
