"""``gossipnet._malloc``: glibc malloc settings, applied once, never over the user's."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
from gossipnet import _malloc
first = _malloc.tune_malloc()
print(first, _malloc.tune_malloc() == first)
"""


def run(env_extra: dict[str, str]) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


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


def test_the_switch_is_a_config_field() -> None:
    from gossipnet import Config

    assert Config().tune_malloc is True
    assert Config(tune_malloc=False).tune_malloc is False
