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


JOIN = """
import logging, sys
import gossipnet
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(message)s")
with gossipnet.join(peers=[], listen="tcp://127.0.0.1:0", tune_malloc={tune}):
    pass
"""


@pytest.mark.timeout(2 * 90 + 10)  # two subprocesses, each bounded above
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_join_tunes_malloc_only_when_config_says_so() -> None:
    """Seen from outside: join() reports the tuning in its log only if asked to tune."""
    import ctypes
    import os

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        pytest.skip("not glibc")

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    said = []
    for tune in (True, False):
        out = subprocess.run(
            [sys.executable, "-c", JOIN.format(tune=tune)],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert out.returncode == 0, out.stderr
        said.append("glibc malloc tuned for large messages" in out.stdout)
    assert said == [True, False]
