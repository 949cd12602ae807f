"""FlatBuffer: one contiguous 1-D bucket per dtype for a list of tensors, zero-copy
where the layout allows; :class:`FlatCache`: one such buffer per layout.

Why in the runtime layer: it is pure tensor layout (no packets, no collective), and the
runtime's surface hands every engine above it the same cached buffers, so it must not
import upward to reach them.  The chunk arithmetic over the buckets
(:class:`~gossipnet.collectives.chunks.ChunkPlan`, ``ShardMap``) stays in
:mod:`gossipnet.collectives.chunks`, which re-exports :class:`FlatBuffer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ("FlatBuffer", "FlatCache")

#: Layouts a :class:`FlatCache` keeps before it is emptied: a training loop uses one or
#: two (gradients, parameters); more means the caller changes layouts as it goes.
_MAX_LAYOUTS = 8


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy ``src[i]`` into ``dst[i]`` without autograd; ``_foreach_copy_`` fuses the
    launches on CUDA (as fast as a loop on CPU); it is private API, hence the fallback."""
    if not dst:
        return
    with torch.no_grad():
        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is not None:
            foreach(dst, src)
        else:  # pragma: no cover - torch < 2.1
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)


def _aliases(view: torch.Tensor, tensor: torch.Tensor) -> bool:
    """True when ``tensor`` already occupies exactly ``view``'s memory, so no copy is due."""
    if tensor.numel() == 0:
        return True
    return tensor.data_ptr() == view.data_ptr() and tensor.is_contiguous()


def _contiguous_run(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view spanning ``tensors`` if they lie back to back in one storage, else None.

    The zero-copy fast path: one contiguous tensor, or tensors adopted by an earlier
    :class:`FlatBuffer`, need no bucket of their own. Zero-size tensors fit anywhere.
    """
    nonempty = [t for t in tensors if t.numel() > 0]
    if not nonempty or not all(t.is_contiguous() for t in nonempty):
        return None
    first = nonempty[0]
    storage_ptr = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in nonempty:
        if t.untyped_storage().data_ptr() != storage_ptr or t.storage_offset() != offset:
            return None
        offset += t.numel()
    total = offset - first.storage_offset()
    return first.detach().as_strided((total,), (1,), first.storage_offset())


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one tensor lives: bucket index and element offset inside it."""

    bucket: int
    offset: int
    shape: torch.Size


class FlatBuffer:
    """One contiguous 1-D bucket per dtype holding the values of a list of tensors.

    Why: the all-reduce works on flat buffers; per-tensor bookkeeping would put Python on
    the per-packet path. Buckets follow each dtype's first appearance in ``tensors`` and
    hold tensors in list order, so peers with the same model build the same layout. The
    constructor copies the current values in, unless the tensors already lie back to back
    in one storage: then the bucket *is* that memory, and writing the bucket writes them.

    Args:
        tensors: any shapes and dtypes (float32/16, bfloat16, float64, ...), one device;
            non-contiguous tensors are copied.

    Raises:
        ValueError: the tensors are on more than one device.
    """

    __slots__ = ("_slots", "_tensors", "_views", "borrowed", "buckets", "device", "dtypes")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors: tuple[torch.Tensor, ...] = tuple(tensors)
        devices = {t.device for t in self._tensors}
        if len(devices) > 1:
            raise ValueError(
                f"FlatBuffer needs tensors on one device, got {sorted(map(str, devices))};"
                " build one FlatBuffer per device"
            )
        self.device: torch.device = devices.pop() if devices else torch.device("cpu")
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(self._tensors):
            groups.setdefault(t.dtype, []).append(i)
        self.dtypes: tuple[torch.dtype, ...] = tuple(groups)
        slots: dict[int, _Slot] = {}
        buckets: list[torch.Tensor] = []
        #: some bucket is the caller's own memory (zero-copy), not one we allocated
        self.borrowed = False
        for b, (dtype, members) in enumerate(groups.items()):
            members_t = [self._tensors[i] for i in members]
            bucket = _contiguous_run(members_t)
            self.borrowed |= bucket is not None
            if bucket is None:
                total = sum(t.numel() for t in members_t)
                bucket = torch.empty(total, dtype=dtype, device=self.device)
            offset = 0
            for i, t in zip(members, members_t, strict=True):
                slots[i] = _Slot(b, offset, t.shape)
                offset += t.numel()
            buckets.append(bucket)
        self.buckets: tuple[torch.Tensor, ...] = tuple(buckets)
        self._slots: tuple[_Slot, ...] = tuple(slots[i] for i in range(len(self._tensors)))
        self._views: tuple[torch.Tensor, ...] = tuple(
            self.buckets[s.bucket].narrow(0, s.offset, s.shape.numel()).view(s.shape)
            for s in self._slots
        )
        self.flatten()

    @classmethod
    def adopt(cls, tensors: Sequence[torch.Tensor]) -> FlatBuffer:
        """Build a FlatBuffer and rebind every tensor to a view of its bucket.

        Why: afterwards :meth:`flatten` and :meth:`unflatten_into` find nothing to copy, so
        the all-reduce reads and writes parameters (or gradients) in place; this is DDP's
        ``gradient_as_bucket_view``. The tensor objects keep their identity (an optimizer
        holding them is unaffected); only their storage changes, via ``Tensor.set_``, so
        they become contiguous. Works for ``nn.Parameter`` and for ``.grad`` tensors.

        Returns:
            The FlatBuffer whose buckets now back ``tensors``.
        """
        flat = cls(tensors)
        with torch.no_grad():
            for view, t in zip(flat._views, flat._tensors, strict=True):
                if not _aliases(view, t):
                    t.set_(view)  # type: ignore[call-overload]  # stubs lack set_(Tensor)
        return flat

    @classmethod
    def adopt_grads(cls, params: Sequence[torch.Tensor]) -> FlatBuffer:
        """Give every parameter a ``.grad`` that is a view of one flat gradient bucket.

        Why: ``.grad`` is None before the first backward, so there is no tensor to adopt;
        this creates zero gradients where missing. Autograd accumulates into an existing
        ``.grad`` in place, so the views survive ``backward()`` and
        ``zero_grad(set_to_none=False)``; ``zero_grad()`` with its default
        ``set_to_none=True`` drops them, after which :meth:`flatten` copies again.

        Returns:
            The FlatBuffer backing the parameters' gradients, values preserved.
        """
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = cls.adopt(grads)
        for p, g in zip(params, grads, strict=True):
            if p.grad is None:
                p.grad = g
        return flat

    def _resolve(self, tensors: Sequence[torch.Tensor] | None) -> Sequence[torch.Tensor]:
        """The tensors to copy, checked against the layout (O(len)); the constructor's own
        are checked too, as ``p.data = ...`` may have rebound them since."""
        if tensors is None:
            tensors = self._tensors
        if len(tensors) != len(self._slots):
            raise ValueError(f"expected {len(self._slots)} tensors, got {len(tensors)}")
        for i, (t, s) in enumerate(zip(tensors, self._slots, strict=True)):
            dtype = self.dtypes[s.bucket]
            if t.shape != s.shape or t.dtype != dtype or t.device != self.device:
                raise ValueError(
                    f"tensor {i} is {tuple(t.shape)} {t.dtype} on {t.device}, the layout"
                    f" expects {tuple(s.shape)} {dtype} on {self.device}"
                )
        return tensors

    def flatten(self, tensors: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """Copy the tensors' values into the buckets; tensors that alias them are skipped.

        Args:
            tensors: same shapes and dtypes as the layout; None means the tensors the
                FlatBuffer was built from.

        Returns:
            :attr:`buckets`, one 1-D tensor per dtype in :attr:`dtypes` order.

        Raises:
            ValueError: ``tensors`` does not match the layout.
        """
        pairs = [
            (v, t)
            for v, t in zip(self._views, self._resolve(tensors), strict=True)
            if not _aliases(v, t)
        ]
        _copy_all([v for v, _ in pairs], [t for _, t in pairs])
        return self.buckets

    def unflatten_into(self, tensors: Sequence[torch.Tensor] | None = None) -> None:
        """Copy the buckets' values back into the tensors, in place.

        Args:
            tensors: as for :meth:`flatten`; may be non-contiguous.

        Raises:
            ValueError: ``tensors`` does not match the layout.
        """
        pairs = [
            (t, v)
            for v, t in zip(self._views, self._resolve(tensors), strict=True)
            if not _aliases(v, t)
        ]
        _copy_all([t for t, _ in pairs], [v for _, v in pairs])

    def segments(self) -> list[list[int]]:
        """Per bucket, the offsets where its tensors start (ascending, from 0): the
        layers a per-layer rule (Accordion) tells apart."""
        out: list[list[int]] = [[] for _ in self.buckets]
        for s in self._slots:
            out[s.bucket].append(s.offset)
        return [sorted(starts) or [0] for starts in out]

    def split(self, buckets: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per tensor, its view of ``buckets`` (any dtype, the layout's lengths), shaped
        like the tensor: per-element side data (ages, weights) mapped back to tensors."""
        if [b.numel() for b in buckets] != [b.numel() for b in self.buckets]:
            raise ValueError("split needs buckets of this layout's lengths")
        return [
            buckets[s.bucket].narrow(0, s.offset, s.shape.numel()).view(s.shape)
            for s in self._slots
        ]

    def backs(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether every one of ``tensors`` already is its slot's view of the buckets."""
        return len(tensors) == len(self._views) and all(
            _aliases(v, t) for v, t in zip(self._views, tensors, strict=True)
        )

    @property
    def numel(self) -> int:
        """Total elements over all buckets."""
        return sum(b.numel() for b in self.buckets)

    def __repr__(self) -> str:
        sizes = [f"{d}: {b.numel()}" for d, b in zip(self.dtypes, self.buckets, strict=True)]
        return f"FlatBuffer({len(self._slots)} tensors; {', '.join(sizes)}; {self.device})"


class FlatCache:
    """One :class:`FlatBuffer` per tensor layout (shapes, dtypes, devices).

    Why: a ``FlatBuffer`` owns the flat buckets that the engines read from and write
    into; building one per call would allocate every step.  Not thread-safe: the
    facade uses it from the caller's thread only.
    """

    def __init__(self) -> None:
        self._flats: dict[tuple[Any, ...], FlatBuffer] = {}

    def get(self, tensors: Sequence[torch.Tensor]) -> FlatBuffer:
        """The buffer for ``tensors``' layout, built on first use.

        A cached buffer that borrowed another list's memory (zero-copy: its bucket
        *is* those tensors) is not reused for other tensors of the same layout:
        flattening them into it would overwrite the first list's values.  Such
        calls get a buffer of their own (zero-copy on them where they allow it),
        which replaces the cached one; a loop that reduces the same tensors every
        step keeps its zero-copy buffer.

        Returns:
            The cached buffer; after more than 8 layouts the cache starts over.
        """
        key = tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)
        flat = self._flats.get(key)
        if flat is not None and flat.borrowed and not flat.backs(tensors):
            flat = None
        if flat is None:
            flat = FlatBuffer(tensors)
            if len(self._flats) > _MAX_LAYOUTS:
                self._flats.clear()
            self._flats[key] = flat
        return flat
