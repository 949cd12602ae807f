"""Where :class:`FlatBuffer` was: it moved down to :mod:`gossipnet.runtime.flatbuffer`.

Why kept: :mod:`gossipnet.collectives.chunks` imports it from here; a re-export costs
nothing and keeps that import working until it names the runtime module.
"""

from __future__ import annotations

from gossipnet.runtime.flatbuffer import FlatBuffer

__all__ = ("FlatBuffer",)
