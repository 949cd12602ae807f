"""Compression for the loss-tolerant all-reduce (ALGORITHMS.md section 6).

``compress=`` on ``net.all_reduce`` and ``net.optimizer(strategy="allreduce")``
takes ``"bf16"``, ``"fp16"``, :class:`Int8`, :class:`ArcTopK`, :class:`DCT` or
:class:`Accordion` (:mod:`.spec`).  The lossy round (:mod:`gossipnet.collectives.lossy`)
calls a :class:`CompressSession` at its per-chunk encode/decode points; the
pure tensor functions are :mod:`.quant`, :mod:`.topk`, :mod:`.dct`,
:mod:`.accordion`, the payload formats :mod:`.payload`.

The rules under loss (each tested in ``tests/unit/test_compress_*``):

- Every compressed packet is decodable alone: it carries its own counts, scale,
  index set or index list (:mod:`.payload`), and is authenticated like any
  packet.  A compressed round sizes its chunks so one compressed chunk fills
  about one packet; losing a packet loses that chunk's values only.
- Owners average what arrived, weighted, divided by the weight that arrived
  (unbiased over arrivals, as on the dense path); a broadcast that is lost
  leaves the receiver's own values (stale) or the estimated step.
- ARC-Top-K index sets are chosen by each chunk's owner and announced with its
  broadcast, tagged with the round; values are added only at the set in force
  (a tag that differs is counted as ``index_mismatch``, never added), a sender
  that missed the announcement sends its sketch only (``missed_announcement``).
  Bootstrap: a set drawn from a seed of (round, bucket, chunk).  See :mod:`.sparse`.
- Error feedback (EF21M for ARC-Top-K, plain EF for DCT): a sent contribution
  stays *pending* until the owner's broadcast answers with a contributor bitmap
  (this round's and the previous round's): counted, it is gone; not counted, it
  returns to the error ``e``.  Both answers lost (about p^2): assumed counted,
  reported as ``ef_unresolved``.  Never counted twice, never dropped unseen.
- ArcTopK's and DCT's ``values=`` (``"fp32"``, ``"bf16"``, ``"int8"``): the values
  travel in that codec, named in each payload (another codec: a counted
  ``compressed_kind`` drop); a contribution's rounding error stays in ``e``, the
  owner's broadcast applies the same rounded values on every peer.
- Quantisers (bf16, fp16, int8) have no error feedback on the gradients.
- The optimizer's parameter broadcast (``param_mode``) is compressed too: each
  owner sends its chunk's *update* from the values every replica holds, which every
  replica adds (:mod:`.sparse`, :meth:`CompressSession.encode_ag`); what it does
  not carry stays in the owner's residual (``gossipnet.training._residual``).

Report keys (``report.extra``): ``bytes_sent`` (every packet of the round this peer
put on the wire: data, copies, ENDs, repairs; :mod:`gossipnet.collectives.lossy.wirebytes`),
``bytes_dense`` (what a dense round of the same settings sends: dense chunks, the
dense round's redundancy and parity, no ``compressed_copies``), ``compression_ratio``
(their ratio), ``index_mismatch``, ``missed_announcement``, ``sketch_only``, ``ef_restored``,
``ef_unresolved`` (this round) and ``ef_unresolved_total``, ``accordion_critical``
(share of the elements in critical layers, the light setting), ``catch_up`` (the
optimizer took Adam's catch-up step), ``dropped_<reason>`` (malformed compressed
payloads this round: ``compressed_index``, ``compressed_count``, ``compressed_age``,
``non_finite``, ...).
"""

from gossipnet.collectives.compress.session import CompressSession, Ledger
from gossipnet.collectives.compress.spec import (
    DCT,
    Accordion,
    ArcTopK,
    Compression,
    Int8,
    resolve,
)

__all__ = (
    "DCT",
    "Accordion",
    "ArcTopK",
    "CompressSession",
    "Compression",
    "Int8",
    "Ledger",
    "resolve",
)
