"""Workloads rebuilt from the facts of the shared GPU recordings (../shared/traces/README.md,
"Workload facts"), written here from those facts and from what the traces show (request sizes,
frame line numbers, the starting state); no code comes from the recordings' repositories.

Two styles of decoder-only TransformerLM, differing where the recordings show different code:

* ``style="course"`` (lm-ctx128-fullstep[-emptycache]): linear layers as ``einsum``, RMSNorm from a
  vector norm, RoPE written into an ``empty_like`` output with per-layer cos/sin tables, the causal
  mask rebuilt each forward from an fp32 ``triu`` cast to bool and inverted, masked_fill over the
  expanded mask, a hand-written softmax (max, exp, sum, div), SwiGLU, a hand-written cross entropy.
* ``style="reference"`` (lm-medium-ctx512-training): RMSNorm computed in fp32 from ``pow``/``mean``/
  ``sqrt``, RoPE as ``stack`` of the two rotated halves with one shared cos/sin table, the mask from
  a position comparison, ``torch.where`` with a scalar, softmax whose ``exp`` runs in fp32 under
  autocast, log-softmax cross entropy.

Optimizers: :class:`LazyAdamW` creates its two state tensors at the first step and a ``sqrt``
temporary per parameter that lives until the next parameter's (a loop variable), as the ctx128
recordings show; :class:`OutOfPlaceAdamW` replaces its state tensors each step.
All sizes follow from the shapes; everything can be built on ``meta``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["TransformerLM", "LazyAdamW", "OutOfPlaceAdamW", "course_loss", "reference_loss"]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("oi,...i->...o", w, x)


class _RMSNorm(nn.Module):
    def __init__(self, d: int, style: str, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.d, self.style, self.eps = d, style, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "course":
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            rms = (norm ** 2 / self.d + self.eps) ** 0.5
            return torch.einsum("...d,d->...d", x / rms, self.weight)
        in_dtype = x.dtype
        x = x.to(torch.float32)
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x / rms
        return (x * self.weight).to(in_dtype)


def _rope_table(max_len: int, d_head: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
    ang = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.cos(ang), torch.sin(ang)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, style: str, max_len: int, theta: float,
                 shared_rope: nn.Module | None) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Parameter(torch.empty(d, d)) for _ in range(4))
        self.h, self.dk, self.style = heads, d // heads, style
        if style == "course":
            cos, sin = _rope_table(max_len, self.dk, theta)
            self.register_buffer("cs", torch.stack([cos, sin]), persistent=False)
        self._shared = [shared_rope]  # not a submodule: shared, registered once on the model

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        if self.style == "course":
            p = pos.expand(b, t)
            cos, sin = self.cs[0][p].unsqueeze(1), self.cs[1][p].unsqueeze(1)
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * cos - x2 * sin
            out[..., 1::2] = x1 * sin + x2 * cos
            return out
        rope = self._shared[0]
        cos, sin = rope.cos[:t], rope.sin[:t]
        r1 = x1 * cos - x2 * sin
        r2 = x1 * sin + x2 * cos
        return torch.stack((r1, r2), dim=-1).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = _linear(x, self.q).view(b, t, self.h, self.dk).transpose(1, 2)
        k = _linear(x, self.k).view(b, t, self.h, self.dk).transpose(1, 2)
        v = _linear(x, self.v).view(b, t, self.h, self.dk).transpose(1, 2)
        if self.style == "course":
            pos = torch.arange(t, device=x.device)
            q, k = self._rope(q, pos), self._rope(k, pos)
            keep = torch.triu(torch.ones(t, t, device=x.device), diagonal=1).bool()
            keep = ~keep
            s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.dk)
            s = s.masked_fill(~keep.expand(b, self.h, t, t), float("-inf"))
            m = s.max(dim=-1, keepdim=True).values
            e = torch.exp(s - m)
            p = e / e.sum(dim=-1, keepdim=True)
        else:
            q, k = self._rope(q, None), self._rope(k, None)
            pos = torch.arange(t, device=x.device)
            keep = pos[:, None] >= pos[None, :]
            s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(self.dk)
            s = torch.where(keep, s, float("-inf"))
            s = s - s.max(dim=-1, keepdim=True).values
            e = torch.exp(s)
            p = e / torch.sum(e, dim=-1, keepdim=True)
        out = torch.einsum("bhqk,bhkd->bhqd", p, v)
        out = out.transpose(1, 2).reshape(b, t, d)
        return _linear(out, self.o)


class _SwiGLU(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (nn.Parameter(torch.empty(*s)) for s in
                                     ((d_ff, d), (d, d_ff), (d_ff, d)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = _linear(x, self.w1)
        a = a * torch.sigmoid(a)
        return _linear(a * _linear(x, self.w3), self.w2)


class _CourseSwiGLU(_SwiGLU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = _linear(x, self.w1), _linear(x, self.w3)
        h = a * torch.sigmoid(a)
        h = h * b
        return _linear(h, self.w2)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, d_ff: int, style: str, max_len: int, theta: float,
                 shared_rope: nn.Module | None) -> None:
        super().__init__()
        self.ln1, self.ln2 = _RMSNorm(d, style), _RMSNorm(d, style)
        self.attn = _Attention(d, heads, style, max_len, theta, shared_rope)
        self.ffn = (_CourseSwiGLU if style == "course" else _SwiGLU)(d, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class _SharedRope(nn.Module):
    def __init__(self, max_len: int, d_head: int, theta: float) -> None:
        super().__init__()
        cos, sin = _rope_table(max_len, d_head, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)


class TransformerLM(nn.Module):
    """Decoder-only LM: embedding, ``layers`` pre-norm blocks (RMSNorm, RoPE attention with a
    materialised score matrix, SwiGLU), final RMSNorm, untied output layer; no biases.

    Input ``(B, T)`` int64 ids, output ``(B, T, vocab)`` logits. ``rope_len`` is the length of the
    cos/sin tables (per layer for ``style="course"``, one shared table for ``"reference"``).
    """

    def __init__(self, *, vocab: int, d_model: int, layers: int, heads: int, d_ff: int,
                 style: str, rope_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.style = style
        self.emb = nn.Parameter(torch.empty(vocab, d_model))
        self.rope = _SharedRope(rope_len, d_model // heads, theta) if style == "reference" else None
        self.blocks = nn.ModuleList(_Block(d_model, heads, d_ff, style, rope_len, theta, self.rope)
                                    for _ in range(layers))
        self.ln_f = _RMSNorm(d_model, style)
        self.head = nn.Parameter(torch.empty(vocab, d_model))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb[ids]
        for blk in self.blocks:
            x = blk(x)
        return _linear(self.ln_f(x), self.head)


def course_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Hand-written cross entropy: max-shift, exp, sum, log, gather, mean (fp32)."""
    z = logits - logits.max(dim=-1, keepdim=True).values
    lse = torch.log(torch.exp(z).sum(dim=-1, keepdim=True))
    picked = z.gather(-1, targets.unsqueeze(-1))
    return (lse - picked).mean()


def reference_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy through a written-out log-softmax (under autocast ``exp``/``log`` run in
    fp32)."""
    z = logits - logits.max(dim=-1, keepdim=True).values
    log_probs = z - torch.log(torch.sum(torch.exp(z), dim=-1, keepdim=True))
    nll = -log_probs
    return nll.gather(-1, targets.unsqueeze(-1)).mean()


class LazyAdamW(torch.optim.Optimizer):
    """AdamW whose ``m``/``v`` are created at the first step (``zeros_like``); the update is in
    place; ``denom = sqrt(v) + eps`` is a per-parameter temporary kept by the loop variable until
    the next parameter's replaces it."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,  # noqa: ANN001
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, st = p.grad, self.state[p]
                if not st:
                    st["t"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["t"] += 1
                t, m, v = st["t"], st["m"], st["v"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                step = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                denom = torch.sqrt(v) + eps
                p.addcdiv_(m, denom, value=-step)
                p.mul_(1 - lr * wd)


class OutOfPlaceAdamW(torch.optim.Optimizer):
    """AdamW written with out-of-place tensor expressions: new ``m``/``v`` each step, the old ones
    released when the next parameter's update rebinds the loop variables; decay and update through
    temporaries (14 requests per parameter, as lm-medium-ctx512-training records)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,  # noqa: ANN001
                 weight_decay: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def init_state(self) -> None:
        """Create the state a few earlier steps leave (``t``, ``m``, ``v``), without stepping."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(t=5, m=torch.zeros_like(p), v=torch.zeros_like(p))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, st = p.grad, self.state[p]
                if not st:  # first step: the state is created lazily
                    st.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["t"] += 1
                t = st["t"]
                p.sub_(p * (lr * wd))
                # the old m and v stay referenced by these loop variables until the next
                # parameter's rebinding (the recordings free them at the next parameter's update)
                m_old = st["m"]
                st["m"] = m_old * b1 + g * (1 - b1)
                v_old = st["v"]
                st["v"] = v_old * b2 + g * g * (1 - b2)
                denom = (st["v"] / (1 - b2 ** t)).sqrt() + eps
                upd = st["m"] / (1 - b1 ** t) * lr / denom
                p.sub_(upd)
