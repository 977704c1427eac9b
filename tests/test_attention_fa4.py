"""FlashAttention-4 as a custom op (``torch.ops.torchtitan_em.fa4_attention``): registered,
traced by ``torch.compile(fullgraph=True)``, differentiated through its registered backward,
kept by selective activation checkpointing; and "auto" falling back to SDPA on a CPU.

The op has only a CUDA kernel in the package. Here a CPU stand-in (softmax attention in
float32, in FA4's layout, returning FA4's log-sum-exp) is registered for the duration of a
test, on a ``torch.library.Library`` fragment that is destroyed afterwards.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtitan.parallelisms.parallelize import _SAVE_OPS, apply_ac

# The module (``torchtitan.models.attention`` as an attribute is the function it exports).
attn = importlib.import_module("torchtitan.models.attention")
CALLS = {"fwd": 0, "bwd": 0}


def _reference(q, k, v):
    """Softmax attention of (B, N, H, D) inputs in float32: (out, lse (B, H, N))."""
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vh
    return out.transpose(1, 2), lse


def _cpu_forward(q, k, v):
    CALLS["fwd"] += 1
    out, lse = _reference(q, k, v)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def _cpu_backward(dout, q, k, v, out, lse):
    """The flash-attention backward from the saved log-sum-exp, written out (a kernel runs
    below autograd, so it cannot ask autograd for these)."""
    CALLS["bwd"] += 1
    scale = q.shape[-1] ** -0.5
    qh, kh, vh, oh, doh = (t.transpose(1, 2).float() for t in (q, k, v, out, dout))
    p = torch.exp(qh @ kh.transpose(-1, -2) * scale - lse.unsqueeze(-1))
    dv = p.transpose(-1, -2) @ doh
    ds = p * (doh @ vh.transpose(-1, -2) - (doh * oh).sum(-1, keepdim=True))
    dq, dk = ds @ kh * scale, ds.transpose(-1, -2) @ qh * scale
    return tuple(g.transpose(1, 2).to(t.dtype).contiguous() for g, t in zip((dq, dk, dv),
                                                                            (q, k, v)))


@pytest.fixture
def cpu_fa4():
    """The op with a CPU stand-in kernel, for this test only."""
    lib = torch.library.Library("torchtitan_em", "FRAGMENT")
    torch.library.register_kernel("torchtitan_em::fa4_attention", "cpu", _cpu_forward, lib=lib)
    torch.library.register_kernel("torchtitan_em::fa4_attention_backward", "cpu", _cpu_backward,
                                  lib=lib)
    CALLS.update(fwd=0, bwd=0)
    yield
    lib._destroy()
    torch._dynamo.reset()


def _qkv(B=2, H=2, N=7, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, N, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def test_op_is_registered_with_shapes_of_fa4():
    assert attn.FA4_OP is torch.ops.torchtitan_em.fa4_attention.default
    assert attn.FA4_OP in _SAVE_OPS  # selective per-op AC keeps its output
    with FakeTensorMode():
        q = torch.empty(2, 33, 4, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.torchtitan_em.fa4_attention(q, q, q)
        assert out.shape == (2, 33, 4, 64) and out.dtype == torch.bfloat16
        assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32
        grads = torch.ops.torchtitan_em.fa4_attention_backward(out, q, q, q, out, lse)
        assert [g.shape for g in grads] == [q.shape] * 3


def test_op_has_no_kernel_outside_cuda():
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(NotImplementedError):
        torch.ops.torchtitan_em.fa4_attention(q, q, q)


def test_opcheck_with_cpu_stand_in(cpu_fa4):
    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in _qkv())
    torch.library.opcheck(torch.ops.torchtitan_em.fa4_attention.default, (q, k, v))


def test_attention_through_op_matches_sdpa_forward_and_backward(cpu_fa4):
    q, k, v = _qkv()
    out = attn.attention(q, k, v, "fa4")  # float32 in: the kernel sees bf16
    assert out.dtype == torch.float32 and out.shape == q.shape
    ref = F.scaled_dot_product_attention(q, k, v)
    assert (out - ref).abs().max() < 2e-2
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v).square().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        assert (g - t.grad).abs().max() < 5e-2 * t.grad.abs().max()
    assert CALLS == {"fwd": 1, "bwd": 1}


def test_compile_fullgraph_traces_op_and_its_backward(cpu_fa4):
    q, k, v = _qkv(dtype=torch.bfloat16)
    fn = torch.compile(lambda q, k, v: attn.attention(q, k, v, "fa4").float().square().sum(),
                       fullgraph=True, backend="aot_eager")
    fn(q, k, v).backward()  # fullgraph=True: a graph break would raise
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))
    assert CALLS == {"fwd": 1, "bwd": 1}


def test_selective_ac_keeps_fa4_output(cpu_fa4):
    """Per-op AC recomputes the block in the backward but not the attention kernel."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).reshape(2, 5, 3, 1, 16).permute(2, 0, 3, 1, 4)
            return attn.attention(q, k, v, "fa4").sum(1)

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block()])
    apply_ac(model, "selective", "op")
    x = torch.randn(2, 5, 16, requires_grad=True)
    model.blocks[0](x).square().sum().backward()
    assert CALLS == {"fwd": 1, "bwd": 1}, CALLS  # no second forward in the recompute
    assert x.grad is not None


def test_auto_falls_back_to_sdpa_on_cpu_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger=attn.logger.name):
        assert attn.resolve_attention_backend("auto", "cpu") == "sdpa"
    assert "using sdpa (FlashAttention-4 needs a CUDA GPU" in caplog.text
    with pytest.raises(RuntimeError, match="attention='fa4' was requested"):
        attn.resolve_attention_backend("fa4", "cpu")
