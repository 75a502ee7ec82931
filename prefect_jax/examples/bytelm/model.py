"""A decoder-only transformer over bytes, in Flax NNX.

Pre-norm blocks (RMSNorm, causal self-attention, GELU MLP, residuals), rotary or learned
positions, 256 input and output tokens. Parameters are float32; ``dtype`` is the compute dtype
(``bfloat16``: every matmul runs in bfloat16 on float32 master weights, and the logits come back
as float32 for the loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB = 256

# nnx.List holds submodules in a list on newer Flax; older Flax took a plain list.
_Modules = getattr(nnx, "List", list)


def dropout(x, rate: float, rng):
    """Inverted dropout with an explicit key (None or rate 0: identity)."""
    if rng is None or rate <= 0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def rotary(x, base: float = 10000.0):
    """Rotary position embedding of ``x`` (batch, seq, heads, head_dim), positions 0..seq-1."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = base ** (-jnp.arange(0, dim // 2, dtype=jnp.float32) * 2.0 / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


class Block(nnx.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)); dropout on each branch's output."""

    def __init__(
        self, d_model: int, n_heads: int, d_ff: int, dtype, rope: bool, attention, *, rngs: nnx.Rngs
    ):
        linear = dict(use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.n_heads, self.rope, self.attention = n_heads, rope, attention
        self.norm1 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(d_model, 3 * d_model, **linear)
        self.proj = nnx.Linear(d_model, d_model, **linear)
        self.norm2 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, **linear)
        self.down = nnx.Linear(d_ff, d_model, **linear)

    def __call__(self, x, rate: float, rng):
        keys = (None, None) if rng is None else tuple(jax.random.split(rng))
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.n_heads, d // self.n_heads) for a in (q, k, v))
        if self.rope:
            q, k = rotary(q), rotary(k)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
        x = x + dropout(self.proj(a.reshape(b, t, d)), rate, keys[0])
        h = jax.nn.gelu(self.up(self.norm2(x)))
        return x + dropout(self.down(h), rate, keys[1])


class ByteTransformer(nnx.Module):
    """Token ids (batch, seq) in 0..255 -> next-token logits (batch, seq, 256), float32.

    Args:
        seq_len: the longest sequence (the learned position table's size).
        d_model, n_layers, n_heads, d_ff: the usual widths and depth.
        positions: ``"rope"`` (rotary, in attention) or ``"learned"`` (a table added to the input).
        dtype: compute dtype (``jnp.float32`` or ``jnp.bfloat16``); parameters stay float32.
        attention: `jax.nn.dot_product_attention`'s implementation (None: JAX's choice).
    """

    def __init__(
        self,
        seq_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_ff: int,
        positions: str = "rope",
        dtype=jnp.float32,
        attention=None,
        *,
        rngs: nnx.Rngs,
    ):
        if positions not in ("rope", "learned"):
            raise ValueError(
                f"positions={positions!r}: use 'rope' (rotary) or 'learned' (a position table)"
            )
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError(
                f"d_model={d_model} must split into n_heads={n_heads} heads of an even width"
            )
        self.dtype = dtype
        self.embed = nnx.Embed(VOCAB, d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.pos = (
            nnx.Embed(seq_len, d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
            if positions == "learned"
            else None
        )
        rope = positions == "rope"
        self.blocks = _Modules(
            [
                Block(d_model, n_heads, d_ff, dtype, rope, attention, rngs=rngs)
                for _ in range(n_layers)
            ]
        )
        self.norm = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(
            d_model, VOCAB, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
        )

    def __call__(self, tokens, rate: float = 0.0, rng=None):
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(jnp.arange(tokens.shape[1]))[None]
        keys = (
            [None] * len(self.blocks)
            if rng is None
            else list(jax.random.split(rng, len(self.blocks) + 1))
        )
        if rng is not None:
            x = dropout(x, rate, keys.pop())
        for block, key in zip(self.blocks, keys, strict=True):
            x = block(x, rate, key)
        return self.head(self.norm(x)).astype(jnp.float32)
