"""The compressors' pure functions on CUDA tensors give the CPU path's results,
and a compressed ``net.all_reduce`` of CUDA tensors works.  Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import gossipnet
from gossipnet.collectives.compress import dct, quant, topk
from gossipnet.testing import run_peers

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _x(n: int = 10_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 3


def test_quantisers_match_cpu() -> None:
    x = _x()
    s_cpu, q_cpu = quant.quantize_int8(x)
    s_gpu, q_gpu = quant.quantize_int8(x.cuda())
    assert q_gpu.is_cuda
    torch.testing.assert_close(s_gpu.cpu(), s_cpu)
    assert (q_gpu.cpu().int() - q_cpu.int()).abs().max() <= 1  # rounding at exact halves
    zs, zq = quant.quantize_int8(torch.zeros(64, device="cuda"))
    assert float(zs) == 0.0
    assert bool((quant.dequantize_int8(zs, zq) == 0).all())
    for name in ("bf16", "fp16"):
        torch.testing.assert_close(quant.to_half(x.cuda(), name).cpu(), quant.to_half(x, name))


def test_topk_and_dct_match_cpu() -> None:
    x = _x()
    sk_cpu, sk_gpu = topk.sketch(x, 16), topk.sketch(x.cuda(), 16)
    torch.testing.assert_close(sk_gpu.cpu(), sk_cpu, rtol=1e-5, atol=1e-6)
    k = topk.nblocks_for(x.numel(), 16, 0.01)
    blocks = topk.choose_blocks(sk_cpu**2, k)
    assert torch.equal(topk.choose_blocks(sk_gpu**2, k).cpu(), blocks)
    idx_gpu = topk.block_indices(blocks.cuda(), 16, x.numel())
    assert torch.equal(idx_gpu.cpu(), topk.block_indices(blocks, 16, x.numel()))
    assert torch.equal(
        topk.compress_at(x.cuda(), idx_gpu).cpu(), topk.compress_at(x, idx_gpu.cpu())
    )
    theta = dct.threshold(x, 0.01)
    assert dct.threshold(x.cuda(), 0.01) == pytest.approx(theta, rel=1e-5)
    assert torch.equal(dct.select(x.cuda(), theta, 200).cpu(), dct.select(x, theta, 200))


def test_compressed_all_reduce_of_cuda_tensors() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> torch.Tensor:
        t = torch.full((50_000,), float(rank + 1), device="cuda")
        rep = peer.all_reduce([t], compress="bf16")
        assert rep.extra["compression_ratio"] > 1.5
        assert t.is_cuda
        return t.cpu()

    out = run_peers(2, body, timeout_s=60)
    for t in out:
        torch.testing.assert_close(t, torch.full((50_000,), 1.5))


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8"])
def test_value_codecs_match_cpu(codec: str) -> None:
    x = _x()
    parts_cpu, dec_cpu = quant.code_values(x, codec)
    parts_gpu, dec_gpu = quant.code_values(x.cuda(), codec)
    assert dec_gpu.is_cuda
    assert [p.dtype for p in parts_gpu] == [p.dtype for p in parts_cpu]
    scale = float(parts_cpu[0][0]) if codec == "int8" else 0.0
    # int8: rounding at exact halves may differ by one step; otherwise bit for bit
    assert float((dec_gpu.cpu() - dec_cpu).abs().max()) <= scale * (1 + 1e-6)


def test_sparse_all_reduce_with_int8_values_of_cuda_tensors() -> None:
    def body(rank: int, peer: gossipnet.Peer) -> torch.Tensor:
        t = torch.full((50_000,), float(rank + 1), device="cuda")
        rep = peer.all_reduce([t], compress=gossipnet.ArcTopK(density=0.1, values="int8"))
        assert rep.extra["compression_ratio"] > 5
        assert t.is_cuda
        return t.cpu()

    out = run_peers(2, body, timeout_s=60)
    assert torch.equal(out[0], out[1])
    at = out[0] != 0
    assert 0.08 * 50_000 <= int(at.sum()) <= 0.15 * 50_000
    torch.testing.assert_close(out[0][at], torch.full((int(at.sum()),), 1.5), rtol=0.01, atol=0)


def test_catch_up_step_on_cuda_matches_cpu() -> None:
    """Adam's catch-up step (ages on the CPU, as the session keeps them) on a CUDA
    parameter gives the CPU step's values and state."""
    from gossipnet.training._catch_up import catch_up_step

    g = torch.Generator().manual_seed(1)
    init = torch.randn(4, 64, generator=g)
    cpu, gpu = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.cuda())
    opt_c = torch.optim.AdamW([cpu], lr=0.01)
    opt_g = torch.optim.AdamW([gpu], lr=0.01)
    for _ in range(4):
        grad = torch.randn(4, 64, generator=g)
        age = (torch.rand(4, 64, generator=g) * 4).floor()  # 0 (not sent) .. 3
        catch_up_step(cpu, grad, age, opt_c.state[cpu], opt_c.param_groups[0])
        catch_up_step(gpu, grad.cuda(), age, opt_g.state[gpu], opt_g.param_groups[0])
    torch.testing.assert_close(gpu.detach().cpu(), cpu.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt_g.state[gpu]["exp_avg_sq"].cpu(), opt_c.state[cpu]["exp_avg_sq"])
