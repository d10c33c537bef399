"""Tiny seeded decoder-only transformer whose attention reads K/V from a paged pool."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .errors import ConfigError

if TYPE_CHECKING:
    from .batch import ForwardBatch
    from .pool import KVPool


@dataclass(frozen=True)
class ModelConfig:
    """Shape, sliding-window layout, dtype and weight seed of a tiny transformer."""

    vocab_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    hidden: int = 64
    intermediate: int = 128
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: torch.dtype = torch.float32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden",
                     "intermediate"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ConfigError("head_dim must be even (RoPE)")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ConfigError("sliding_layers must index existing layers")
        if len(set(self.sliding_layers)) != len(self.sliding_layers):
            raise ConfigError("sliding_layers must be unique")
        if self.sliding_layers and self.sliding_window <= 0:
            raise ConfigError("sliding layers need sliding_window > 0")
        if not self.dtype.is_floating_point:
            raise ConfigError("dtype must be a floating point dtype")

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layers that attend over the whole context (and use the FULL pool)."""
        return tuple(i for i in range(self.num_layers) if i not in self.sliding_layers)

    def window_of(self, layer: int) -> int:
        """Sliding window of a layer, 0 for full-attention layers."""
        return self.sliding_window if layer in self.sliding_layers else 0


@dataclass
class _LayerWeights:
    """Weights of one decoder layer."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclass
class _Weights:
    """All weights of the model."""

    embed: torch.Tensor
    layers: list[_LayerWeights] = field(default_factory=list)
    final_norm: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    lm_head: torch.Tensor = field(default_factory=lambda: torch.empty(0))


def _init_weights(cfg: ModelConfig, device: torch.device) -> _Weights:
    """Draw every weight from a CPU generator seeded with cfg.seed (device independent)."""
    gen = torch.Generator().manual_seed(cfg.seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=gen, dtype=torch.float64) / math.sqrt(rows)
        return w.to(device=device, dtype=cfg.dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=cfg.dtype)

    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    embed = torch.randn(cfg.vocab_size, cfg.hidden, generator=gen, dtype=torch.float64)
    weights = _Weights(embed=embed.to(device=device, dtype=cfg.dtype))
    for _ in range(cfg.num_layers):
        weights.layers.append(_LayerWeights(
            attn_norm=ones(cfg.hidden), wq=mat(cfg.hidden, q_out), wk=mat(cfg.hidden, kv_out),
            wv=mat(cfg.hidden, kv_out), wo=mat(q_out, cfg.hidden), mlp_norm=ones(cfg.hidden),
            w_gate=mat(cfg.hidden, cfg.intermediate), w_up=mat(cfg.hidden, cfg.intermediate),
            w_down=mat(cfg.intermediate, cfg.hidden)))
    weights.final_norm = ones(cfg.hidden)
    weights.lm_head = mat(cfg.hidden, cfg.vocab_size) * 4.0
    return weights


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x is [tokens, heads, head_dim], cos/sin [tokens, head_dim/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Causal (optionally sliding) GQA attention of one request; returns [q_len, heads, dim]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask = mask & (k_pos[None, :] > q_pos[:, None] - window)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


class TinyTransformer:
    """Deterministic decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU MLP) over a paged pool."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.weights = _init_weights(config, self.device)
        dim = torch.arange(0, config.head_dim, 2, dtype=torch.float64, device=self.device)
        self._inv_freq = 1.0 / (config.rope_theta ** (dim / config.head_dim))

    def forward(self, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """Write the batch's new K/V into the pool, attend through req_to_token, return logits."""
        cfg, w = self.config, self.weights
        with torch.no_grad():
            h = w.embed[batch.input_ids]
            angles = batch.positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
            cos, sin = angles.cos().to(cfg.dtype), angles.sin().to(cfg.dtype)
            for i, layer in enumerate(w.layers):
                x = _rms_norm(h, layer.attn_norm, cfg.norm_eps)
                h = h + self._attention(i, layer, x, cos, sin, batch, pool)
                x = _rms_norm(h, layer.mlp_norm, cfg.norm_eps)
                h = h + (torch.nn.functional.silu(x @ layer.w_gate) * (x @ layer.w_up)) @ layer.w_down
            return _rms_norm(h, w.final_norm, cfg.norm_eps) @ w.lm_head

    def _attention(self, index: int, layer: _LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """One attention block: project, rotate, store new K/V, read each request's K/V."""
        cfg, n = self.config, x.shape[0]
        q = _rope((x @ layer.wq).view(n, cfg.num_heads, cfg.head_dim), cos, sin)
        k = _rope((x @ layer.wk).view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = (x @ layer.wv).view(n, cfg.num_kv_heads, cfg.head_dim)
        pool.write(index, batch.out_cache_loc, k, v)
        window = cfg.window_of(index)
        outs, offset = [], 0
        for row, pre, ext in zip(batch.req_pool_indices_host, batch.prefix_lens_host,
                                 batch.extend_lens_host, strict=False):
            lo = max(0, pre - window + 1) if window else 0
            slots = batch.req_to_token[row, lo:pre + ext]
            kk, vv = pool.read(index, slots)
            q_pos = torch.arange(pre, pre + ext, device=x.device)
            k_pos = torch.arange(lo, pre + ext, device=x.device)
            outs.append(_attend(q[offset:offset + ext], kk, vv, q_pos, k_pos, window))
            offset += ext
        return torch.cat(outs).reshape(n, -1) @ layer.wo
