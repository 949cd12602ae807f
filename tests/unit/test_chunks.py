"""Unit tests for gossipnet.collectives.chunks: layout, zero-copy paths, chunking, ownership."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipnet.collectives.chunks import ChunkPlan, FlatBuffer, ShardMap, as_bytes, from_bytes

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SHAPES = ((3, 4), (7,), (), (2, 3, 5), (0,), (1, 1), (129,))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes, so equality is bit-exact (NaN payloads and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _mixed(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=gen, dtype=torch.float64).to(DTYPES[i % len(DTYPES)])
        for i, shape in enumerate(SHAPES * 2)
    ]


# --- FlatBuffer -------------------------------------------------------------------------


def test_round_trip_mixed_shapes_and_dtypes_is_bit_exact() -> None:
    src = _mixed(1)
    src[0].view(-1)[0] = float("nan")
    src[1].view(-1)[0] = -0.0
    flat = FlatBuffer(src)
    assert flat.dtypes == DTYPES
    assert [b.dtype for b in flat.buckets] == list(DTYPES)
    assert flat.numel == sum(t.numel() for t in src)
    dst = [torch.empty_like(t) for t in src]
    flat.unflatten_into(dst)
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_buckets_hold_values_in_list_order() -> None:
    a, b, c = torch.arange(3.0), torch.arange(4, dtype=torch.float16), torch.tensor([[7.0]])
    flat = FlatBuffer([a, b, c])
    assert torch.equal(flat.buckets[0], torch.tensor([0.0, 1.0, 2.0, 7.0]))
    assert torch.equal(flat.buckets[1], b)


def test_flatten_refreshes_values_and_accepts_other_tensors() -> None:
    src = _mixed(2)
    flat = FlatBuffer(src)
    other = _mixed(3)
    flat.flatten(other)
    out = [torch.zeros_like(t) for t in src]
    flat.unflatten_into(out)
    assert all(torch.equal(_bits(o), _bits(t)) for o, t in zip(out, other, strict=True))
    for t in src:
        t.add_(1)
    flat.flatten()  # None: the constructor's tensors, current values
    flat.unflatten_into(out)
    assert all(torch.equal(_bits(o), _bits(t)) for o, t in zip(out, src, strict=True))


def test_single_contiguous_tensor_is_the_bucket() -> None:
    t = torch.randn(5, 6)
    flat = FlatBuffer([t])
    (bucket,) = flat.buckets
    assert bucket.data_ptr() == t.data_ptr()
    assert bucket.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    bucket[3] = 42.0  # same memory, both ways
    assert t.view(-1)[3] == 42.0
    t.zero_()
    assert flat.flatten()[0].abs().sum() == 0


def test_back_to_back_views_share_one_bucket() -> None:
    base = torch.randn(20)
    parts = [base[0:6].view(2, 3), base[6:6], base[6:20]]
    flat = FlatBuffer(parts)
    assert flat.buckets[0].data_ptr() == base.data_ptr()
    assert flat.buckets[0].numel() == 20


def test_gap_or_non_contiguous_input_is_copied_correctly() -> None:
    base = torch.randn(20)
    gap = FlatBuffer([base[0:5], base[6:10]])
    assert gap.buckets[0].data_ptr() != base.data_ptr()
    assert torch.equal(gap.buckets[0], torch.cat([base[0:5], base[6:10]]))
    mat = torch.randn(4, 6)
    orig = mat.clone()
    nc = mat.t()
    assert not nc.is_contiguous()
    flat = FlatBuffer([nc])
    assert flat.buckets[0].data_ptr() != mat.data_ptr()
    assert torch.equal(flat.buckets[0], nc.reshape(-1))
    flat.buckets[0].mul_(2)
    flat.unflatten_into()
    assert torch.equal(mat, orig * 2)  # written back through the transposed view
    assert torch.equal(nc.reshape(-1), flat.buckets[0])


def test_adopt_makes_tensors_views_and_flatten_free() -> None:
    params = [torch.nn.Parameter(t.float()) for t in _mixed(4)]
    values = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    flat = FlatBuffer.adopt(params)
    assert [id(p) for p in params] == ids
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in params)
    assert all(torch.equal(p.detach(), v) for p, v in zip(params, values, strict=True))
    storage = flat.buckets[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in params if p.numel())
    flat.buckets[0].fill_(3.0)  # the all-reduce writes the bucket; params see it
    assert all(bool((p == 3.0).all()) for p in params)
    again = FlatBuffer(params)  # already back to back: aliases instead of copying
    assert again.buckets[0].data_ptr() == flat.buckets[0].data_ptr()


def test_adopt_grads_survive_backward() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    flat = FlatBuffer.adopt_grads(params)
    assert flat.buckets[0].abs().sum() == 0
    model(torch.randn(5, 4)).sum().backward()
    assert flat.buckets[0].abs().sum() > 0
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    assert torch.equal(flat.buckets[0], grads)
    ptr = flat.buckets[0].data_ptr()
    assert params[0].grad.data_ptr() == ptr
    model.zero_grad(set_to_none=False)
    assert flat.buckets[0].abs().sum() == 0
    assert params[0].grad.data_ptr() == ptr


def test_edge_cases_empty_and_zero_size() -> None:
    empty = FlatBuffer([])
    assert empty.buckets == ()
    assert empty.flatten() == ()
    assert empty.numel == 0
    empty.unflatten_into([])
    zeros = FlatBuffer([torch.empty(0), torch.empty(0, 3)])
    assert zeros.buckets[0].numel() == 0
    zeros.unflatten_into([torch.empty(0), torch.empty(0, 3)])


def test_layout_mismatch_and_mixed_devices_raise() -> None:
    flat = FlatBuffer([torch.zeros(3)])
    with pytest.raises(ValueError, match="expected 1 tensors"):
        flat.flatten([])
    with pytest.raises(ValueError, match="expects"):
        flat.flatten([torch.zeros(4)])
    with pytest.raises(ValueError, match="expects"):
        flat.unflatten_into([torch.zeros(3, dtype=torch.float16)])
    with pytest.raises(ValueError, match="one device"):
        FlatBuffer([torch.zeros(1), torch.zeros(1, device="meta")])


# --- ChunkPlan and bytes ----------------------------------------------------------------


@settings(derandomize=True, max_examples=200, deadline=None)
@given(
    numel=st.integers(0, 100_000),
    chunk_bytes=st.integers(8, 5_000),
    dtype=st.sampled_from(DTYPES),
)
def test_chunks_cover_buffer_exactly_once(numel: int, chunk_bytes: int, dtype: torch.dtype) -> None:
    plan = ChunkPlan(numel=numel, dtype=dtype, chunk_bytes=chunk_bytes)
    assert plan.chunk_elems == chunk_bytes // dtype.itemsize
    assert len(plan.offsets) == plan.nchunks
    # Chunk i starts where chunk i-1 ended and the last ends at numel: an exact tiling.
    end = 0
    for i, start in enumerate(plan.offsets):
        offset, count = plan.chunk(i)
        assert offset == start == end
        assert 0 < count * dtype.itemsize <= chunk_bytes
        assert count == plan.chunk_elems or i == plan.nchunks - 1
        size = dtype.itemsize
        assert plan.byte_slice(i) == slice(offset * size, (offset + count) * size)
        end += count
    assert end == numel
    buffer = torch.zeros(numel, dtype=dtype)
    for i in {0, plan.nchunks - 1} & set(range(plan.nchunks)):
        offset, count = plan.chunk(i)
        view = plan.view(buffer, i)
        assert view.numel() == count
        assert view.data_ptr() == buffer.data_ptr() + offset * dtype.itemsize
    for bad in (-1, plan.nchunks):
        with pytest.raises(IndexError):
            plan.chunk(bad)


def test_plan_edge_cases() -> None:
    small = ChunkPlan(numel=5, dtype=torch.float32, chunk_bytes=1400)
    assert (small.nchunks, small.chunk(0)) == (1, (0, 5))
    assert ChunkPlan(numel=0, dtype=torch.float32, chunk_bytes=64).nchunks == 0
    odd = ChunkPlan(numel=10, dtype=torch.float64, chunk_bytes=20)  # 2.5 elements -> 2
    assert (odd.chunk_elems, odd.nchunks, odd.chunk(4)) == (2, 5, (8, 2))
    with pytest.raises(ValueError, match="holds no"):
        ChunkPlan(numel=10, dtype=torch.float64, chunk_bytes=7)
    with pytest.raises(ValueError, match=">= 0"):
        ChunkPlan(numel=-1, dtype=torch.float32, chunk_bytes=64)
    with pytest.raises(ValueError, match="does not match"):
        small.view(torch.zeros(6), 0)
    big = ChunkPlan(numel=10**12, dtype=torch.float32, chunk_bytes=1400)  # O(1): no lists
    assert big.chunk(big.nchunks - 1) == (big.offsets[-1], 10**12 - big.offsets[-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_round_trip_is_bit_exact_and_zero_copy(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    bucket = torch.randn(1000, generator=gen, dtype=torch.float64).to(dtype)
    plan = ChunkPlan.for_tensor(bucket, chunk_bytes=256)
    raw = as_bytes(bucket)
    assert raw.nbytes == bucket.numel() * dtype.itemsize
    assert raw.format == "B"
    assert bytes(raw[:2]) == bytes(_bits(bucket[:1]).numpy()[:2])  # native bytes, no swap
    out = torch.empty_like(bucket)
    for i in range(plan.nchunks):
        payload = raw[plan.byte_slice(i)]
        assert bytes(payload) == bytes(as_bytes(plan.view(bucket, i)))
        offset, count = plan.chunk(i)
        received = from_bytes(bytes(payload), dtype, count)  # read-only, like a zmq frame
        out[offset : offset + count] = received
    assert torch.equal(_bits(out), _bits(bucket))
    writable = bytearray(raw)
    shared = from_bytes(writable, dtype, bucket.numel())
    shared[0] = 0  # zero-copy: the tensor reads and writes the bytearray itself
    assert writable[: dtype.itemsize] == bytes(dtype.itemsize)
    view = from_bytes(raw, dtype, bucket.numel())
    assert view.data_ptr() == bucket.data_ptr()


def test_bytes_edge_cases() -> None:
    assert from_bytes(b"", torch.bfloat16, 0).numel() == 0
    assert as_bytes(torch.empty(0)).nbytes == 0
    with pytest.raises(ValueError, match="does not hold"):
        from_bytes(b"abc", torch.float16, 2)
    with pytest.raises(ValueError, match="does not hold"):
        from_bytes(b"", torch.float16, -1)
    with pytest.raises(ValueError, match="contiguous CPU"):
        as_bytes(torch.zeros(3, 4).t())
    param = torch.nn.Parameter(torch.ones(2))
    assert as_bytes(param).nbytes == 8  # requires_grad is fine


# --- ShardMap ---------------------------------------------------------------------------


def _all_owners(shards: ShardMap) -> list[str]:
    return [shards.owner(c) for c in range(shards.plan.nchunks)]


@settings(derandomize=True, max_examples=200, deadline=None)
@given(nchunks=st.integers(0, 300), npeers=st.integers(1, 40))
def test_shard_map_contiguous_balanced_exactly_once(nchunks: int, npeers: int) -> None:
    plan = ChunkPlan(numel=nchunks * 3 - (1 if nchunks else 0), dtype=torch.float32, chunk_bytes=12)
    assert plan.nchunks == nchunks
    peers = tuple(f"peer-{j:02d}" for j in range(npeers))
    shards = ShardMap(plan, peers)
    owners = _all_owners(shards)
    ranges = [shards.chunks_of(p) for p in peers]
    assert [c for r in ranges for c in r] == list(range(nchunks))  # once each, in order
    assert all(owners[c] == p for p, r in zip(peers, ranges, strict=True) for c in r)
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    spans = [shards.owned_range(p) for p in peers]
    assert [i for s in spans for i in s] == list(range(plan.numel))
    assert ShardMap(plan, list(peers)) == shards  # deterministic, list or tuple
    assert _all_owners(ShardMap(plan, peers)) == owners


def test_shard_map_edge_cases() -> None:
    plan = ChunkPlan(numel=10, dtype=torch.float32, chunk_bytes=8)  # 5 chunks
    solo = ShardMap(plan, ["a"])
    assert solo.chunks_of("a") == range(5)
    assert solo.owned_range("a") == range(10)
    crowd = ShardMap(plan, [f"p{j}" for j in range(8)])
    assert [len(crowd.chunks_of(f"p{j}")) for j in range(8)] == [1] * 5 + [0] * 3
    assert crowd.owned_range("p7") == range(10, 10)
    buffer = torch.arange(10.0)
    shard = crowd.view(buffer, "p2")
    assert torch.equal(shard, torch.tensor([4.0, 5.0]))
    assert shard.data_ptr() == buffer[4:].data_ptr()
    assert crowd.view(buffer, "p7").numel() == 0
    assert ShardMap(ChunkPlan(numel=0, dtype=torch.float32, chunk_bytes=8), ["a"]).chunks_of(
        "a"
    ) == range(0)
    with pytest.raises(KeyError, match="not a participant"):
        solo.chunks_of("zz")
    with pytest.raises(IndexError):
        solo.owner(5)
    with pytest.raises(ValueError, match="at least one"):
        ShardMap(plan, [])
    with pytest.raises(ValueError, match="duplicates"):
        ShardMap(plan, ["a", "b", "a"])
    assert ShardMap(plan, ["b", "a"]).owner(0) == "b"  # caller's order is the agreed order


def test_parameters_flatten_without_autograd() -> None:
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    flat = FlatBuffer(params)
    assert not flat.buckets[0].requires_grad
    flat.buckets[0].zero_()
    flat.unflatten_into()  # in-place write into leaves that require grad: no error
    assert all(bool((p == 0).all()) for p in params)
    assert all(p.grad_fn is None for p in params)


def test_public_names_are_pinned() -> None:
    from gossipnet.collectives import chunks

    assert chunks.__all__ == (
        "ChunkPlan",
        "FlatBuffer",
        "ShardMap",
        "all_finite",
        "as_bytes",
        "auto_chunk_bytes",
        "from_bytes",
        "worth_stacking",
    )


def test_auto_chunk_bytes_grows_with_the_bucket_within_bounds() -> None:
    from gossipnet.collectives.chunks import AUTO_CHUNKS, auto_chunk_bytes

    base, cap = 256 * 1024, 1024 * 1024
    assert auto_chunk_bytes(1000, base, cap) == base  # small buckets keep the base size
    assert auto_chunk_bytes(AUTO_CHUNKS * base, base, cap) == base
    assert auto_chunk_bytes(AUTO_CHUNKS * base + 1, base, cap) == 2 * base
    assert auto_chunk_bytes(10**9, base, cap) == cap  # never past the cap
    assert auto_chunk_bytes(10**9, 1024, 1024) == 1024  # no growth where cap <= base (UDP)
    for n in range(0, 40 * base, 977 * 13):
        size = auto_chunk_bytes(n, base, cap)
        assert size % base == 0
        assert base <= size <= cap
    # with a participant count: one chunk per owner until the cap
    assert auto_chunk_bytes(4 * cap, base, cap, chunks=4) == cap
    assert auto_chunk_bytes(2 * cap, base, cap, chunks=4) == cap // 2
    assert auto_chunk_bytes(3 * base, base, cap, chunks=4) == base  # never below the base
    assert auto_chunk_bytes(10**9, base, cap, chunks=0) == cap  # a degenerate count is safe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_all_finite_finds_every_nan_and_inf(dtype: torch.dtype) -> None:
    from gossipnet.collectives.chunks import all_finite

    x = torch.linspace(-100, 100, 1001).to(dtype)
    assert all_finite(x)
    assert all_finite(torch.empty(0, dtype=dtype))
    assert all_finite(torch.arange(5))  # integers are always finite
    if dtype in (torch.float16, torch.bfloat16):
        assert all_finite(torch.full((4096,), 60000.0, dtype=dtype))  # a sum would overflow
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 500, 1000):
            y = x.clone()
            y[where] = bad
            assert not all_finite(y), (bad, where)
    mixed = x.clone()
    mixed[3], mixed[7] = float("inf"), float("-inf")  # inf - inf = nan: still caught
    assert not all_finite(mixed)
