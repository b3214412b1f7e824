"""Models written only for the planner's tests: names and layouts of their own (none of GPT's or
Llama's attribute names), each forward(inputs, targets) -> scalar loss.

    Stack      an MLP-only residual stack on float features, a regression head (MSE)
    Encoder    BERT-like: bidirectional attention with biases, post-norm, learned positions,
               feed-forward Linears held directly by the layer, a masked-LM head
    Fused      one fused q/k/v Linear, heads-major ((B, T, heads, 3 * head_dim), Megatron's
               own fused layout) or q|k|v-major (nanoGPT's .split(C, dim=2))
    Parallel   GPT-J style: attention and MLP read one norm, their sum joins the residual
    Mixture    a mixture-of-experts MLP: a softmax router over experts in a ModuleList
    Shared     ALBERT-like: one layer applied at every depth (its weights used several times),
               q/k/v with biases and a per-head RMSNorm on queries and keys (as Qwen3), a
               Sequential feed-forward
    Nano       nanoGPT's layout: a ModuleDict trunk, one c_attn Linear split q|k|v-major,
               attention written out (a causal mask, softmax, dropout), a tied head
"""
from __future__ import annotations

import numpy as np

from dtensor import arange, as_tensor, where
from dtensor.nn import (GELU, Dropout, Embedding, LayerNorm, Linear, Module, ModuleDict,
                        ModuleList, RMSNorm, RotaryEmbedding, Sequential)
from dtensor.nn import functional as F
from dtensor.nn.layers import apply_rotary

VOCAB, WIDTH, HEADS, SEQ = 24, 16, 4, 8


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------- Stack

class _Ff(Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.scale = RMSNorm(width)
        self.widen = Linear(width, hidden)
        self.narrow = Linear(hidden, width)

    def forward(self, x):
        return x + self.narrow(F.relu(self.widen(self.scale(x))))


class Stack(Module):
    def __init__(self, width=WIDTH, hidden=40, depth=3):
        super().__init__()
        self.trunk = ModuleList([_Ff(width, hidden) for _ in range(depth)])
        self.readout = Linear(width, 1)

    def forward(self, x, y):
        for f in self.trunk:
            x = f(x)
        return ((self.readout(x) - y) ** 2).mean()

    @staticmethod
    def batch(rng, B=4):
        return (rng.standard_normal((B, SEQ, WIDTH)).astype(np.float32),
                rng.standard_normal((B, SEQ, 1)).astype(np.float32))


# ----------------------------------------------------------------------------- Encoder

class _SelfAttention(Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (Linear(width, width) for _ in range(3))
        self.dense = Linear(width, width)

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.heads, -1).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                           split(self.value(x)))
        return self.dense(y.transpose(1, 2).reshape(B, T, -1))


class _EncoderLayer(Module):
    def __init__(self, width, heads, hidden):
        super().__init__()
        self.attention = _SelfAttention(width, heads)
        self.after_attention = LayerNorm(width)
        self.intermediate = Linear(width, hidden)
        self.output = Linear(hidden, width)
        self.after_output = LayerNorm(width)

    def forward(self, x):
        x = self.after_attention(x + self.attention(x))
        return self.after_output(x + self.output(F.gelu(self.intermediate(x))))


class Encoder(Module):
    def __init__(self, vocab=VOCAB, width=WIDTH, heads=HEADS, hidden=36, depth=2, seq=SEQ):
        super().__init__()
        self.words = Embedding(vocab, width)
        self.positions = Embedding(seq, width)
        self.embedding_norm = LayerNorm(width)
        self.encoder = ModuleList([_EncoderLayer(width, heads, hidden) for _ in range(depth)])
        self.predictions = Linear(width, vocab)

    def forward(self, ids, labels):
        x = self.words(ids) + self.positions(arange(ids.shape[1], dtype=np.int64))
        x = self.embedding_norm(x)
        for layer in self.encoder:
            x = layer(x)
        return _lm_loss(self.predictions(x), labels)

    @staticmethod
    def batch(rng, B=4):
        return rng.integers(0, VOCAB, (B, SEQ)), rng.integers(0, VOCAB, (B, SEQ))


# ----------------------------------------------------------------------------- Fused

class _FusedAttention(Module):
    def __init__(self, width, heads, heads_major, kv_heads=None):
        super().__init__()
        self.heads, self.heads_major = heads, heads_major
        self.kv_heads = kv_heads or heads
        self.kv_width = width // heads * self.kv_heads
        self.qkv = Linear(width, width + 2 * self.kv_width, bias=False)
        self.out = Linear(width, width, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        if self.heads_major:  # (B, T, heads, 3 * head_dim): q, k, v of a head side by side
            q, k, v = self.qkv(x).view(B, T, self.heads, -1).transpose(1, 2).chunk(3, dim=-1)
        else:  # [q | k | v] over the whole width (k and v narrower under GQA, as Phi-3's)
            q, k, v = self.qkv(x).split([C, self.kv_width, self.kv_width], dim=2)
            q = q.view(B, T, self.heads, -1).transpose(1, 2)
            k, v = (t.view(B, T, self.kv_heads, -1).transpose(1, 2).repeat_interleave(
                self.heads // self.kv_heads, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class _FusedBlock(Module):
    def __init__(self, width, heads, heads_major, kv_heads=None):
        super().__init__()
        self.pre = RMSNorm(width)
        self.mix = _FusedAttention(width, heads, heads_major, kv_heads)
        self.pre2 = RMSNorm(width)
        self.up = Linear(width, 2 * width, bias=False)
        self.down = Linear(2 * width, width, bias=False)

    def forward(self, x):
        x = x + self.mix(self.pre(x))
        return x + self.down(F.silu(self.up(self.pre2(x))))


class Fused(Module):
    def __init__(self, heads_major=True, vocab=VOCAB, width=WIDTH, heads=HEADS, depth=2,
                 kv_heads=None):
        super().__init__()
        self.table = Embedding(vocab, width)
        self.body = ModuleList([_FusedBlock(width, heads, heads_major, kv_heads)
                                for _ in range(depth)])
        self.final = RMSNorm(width)
        self.unembed = Linear(width, vocab, bias=False)
        self.unembed.weight = self.table.weight  # tied

    def forward(self, ids, targets):
        x = self.table(ids)
        for b in self.body:
            x = b(x)
        return _lm_loss(self.unembed(self.final(x)), targets)

    batch = Encoder.batch


# ----------------------------------------------------------------------------- Parallel

class _Mix(Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (Linear(width, width, bias=False) for _ in range(4))
        self.rope = RotaryEmbedding(width // heads)

    def forward(self, h):
        B, T, C = h.shape
        split = lambda t: t.view(B, T, self.heads, -1).transpose(1, 2)  # noqa: E731
        cos, sin = self.rope.cos_sin(arange(T, dtype=np.int64))
        q, k = apply_rotary(split(self.wq(h)), cos, sin), apply_rotary(split(self.wk(h)), cos, sin)
        y = F.scaled_dot_product_attention(q, k, split(self.wv(h)), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class _ParallelBlock(Module):
    def __init__(self, width, heads, hidden):
        super().__init__()
        self.ln = LayerNorm(width)
        self.mix = _Mix(width, heads)
        self.ffn_in = Linear(width, hidden)
        self.ffn_out = Linear(hidden, width)

    def forward(self, x):
        h = self.ln(x)
        return x + self.mix(h) + self.ffn_out(F.gelu(self.ffn_in(h)))


class Parallel(Module):
    def __init__(self, vocab=VOCAB, width=WIDTH, heads=HEADS, hidden=44, depth=2):
        super().__init__()
        self.emb = Embedding(vocab, width)
        self.layers = ModuleList([_ParallelBlock(width, heads, hidden) for _ in range(depth)])
        self.ln_out = LayerNorm(width)
        self.logits = Linear(width, vocab)

    def forward(self, ids, targets):
        x = self.emb(ids)
        for b in self.layers:
            x = b(x)
        return _lm_loss(self.logits(self.ln_out(x)), targets)

    batch = Encoder.batch


# ----------------------------------------------------------------------------- Mixture

class _Expert(Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.w_in, self.w_out = Linear(width, hidden, bias=False), Linear(hidden, width,
                                                                          bias=False)

    def forward(self, x):
        return self.w_out(F.silu(self.w_in(x)))


class _Moe(Module):
    def __init__(self, width, hidden, n_experts):
        super().__init__()
        self.router = Linear(width, n_experts, bias=False)
        self.experts = ModuleList([_Expert(width, hidden) for _ in range(n_experts)])

    def forward(self, x):
        gates = F.softmax(self.router(x), dim=-1)
        out = None
        for e, expert in enumerate(self.experts):
            y = gates[..., e:e + 1] * expert(x)
            out = y if out is None else out + y
        return out


class Mixture(Module):
    def __init__(self, vocab=VOCAB, width=WIDTH, hidden=12, n_experts=3, depth=2):
        super().__init__()
        self.tokens = Embedding(vocab, width)
        self.norms = ModuleList([RMSNorm(width) for _ in range(depth)])
        self.moes = ModuleList([_Moe(width, hidden, n_experts) for _ in range(depth)])
        self.head = Linear(width, vocab, bias=False)

    def forward(self, ids, targets):
        x = self.tokens(ids)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return _lm_loss(self.head(x), targets)

    batch = Encoder.batch


# ----------------------------------------------------------------------------- Shared

class _QkNormAttention(Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (Linear(width, width) for _ in range(3))
        self.q_norm, self.k_norm = RMSNorm(width // heads), RMSNorm(width // heads)
        self.to_out = Linear(width, width, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        split = lambda t: t.view(B, T, self.heads, -1).transpose(1, 2)  # noqa: E731
        q, k = self.q_norm(split(self.to_q(x))), self.k_norm(split(self.to_k(x)))
        y = F.scaled_dot_product_attention(q, k, split(self.to_v(x)), is_causal=True)
        return self.to_out(y.transpose(1, 2).reshape(B, T, C))


class _SharedLayer(Module):
    def __init__(self, width, heads, hidden):
        super().__init__()
        self.n1, self.n2 = LayerNorm(width), LayerNorm(width)
        self.attend = _QkNormAttention(width, heads)
        self.ff = Sequential(Linear(width, hidden), GELU(), Linear(hidden, width))

    def forward(self, x):
        x = x + self.attend(self.n1(x))
        return x + self.ff(self.n2(x))


class Shared(Module):
    def __init__(self, vocab=VOCAB, width=WIDTH, heads=HEADS, hidden=32, depth=3):
        super().__init__()
        self.depth = depth
        self.vocab = Embedding(vocab, width)
        self.layer = _SharedLayer(width, heads, hidden)
        self.norm = LayerNorm(width)
        self.out = Linear(width, vocab, bias=False)

    def forward(self, ids, targets):
        x = self.vocab(ids)
        for _ in range(self.depth):
            x = self.layer(x)
        return _lm_loss(self.out(self.norm(x)), targets)

    batch = Encoder.batch


# ----------------------------------------------------------------------------- Nano

class _NanoAttention(Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = Linear(width, 3 * width), Linear(width, width)
        self.attn_dropout, self.resid_dropout = Dropout(0.1), Dropout(0.1)
        self.causal = np.tril(np.ones((SEQ, SEQ), bool))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * k.shape[-1] ** -0.5
        att = F.softmax(where(as_tensor(self.causal[:T, :T]), att, float("-inf")), dim=-1)
        y = (self.attn_dropout(att) @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class _NanoBlock(Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = LayerNorm(width), _NanoAttention(width, heads), \
            LayerNorm(width)
        self.c_fc, self.c_proj = Linear(width, 4 * width), Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class Nano(Module):
    def __init__(self, vocab=VOCAB, width=WIDTH, heads=HEADS, depth=2):
        super().__init__()
        self.transformer = ModuleDict(dict(
            wte=Embedding(vocab, width), wpe=Embedding(SEQ, width), drop=Dropout(0.1),
            h=ModuleList([_NanoBlock(width, heads) for _ in range(depth)]),
            ln_f=LayerNorm(width)))
        self.lm_head = Linear(width, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(arange(idx.shape[1], dtype=np.int64)))
        for block in t.h:
            x = block(x)
        return _lm_loss(self.lm_head(t.ln_f(x)), targets)

    batch = Encoder.batch


MODELS = {"stack": Stack, "encoder": Encoder, "fused": lambda: Fused(True),
          "fused_qkv_major": lambda: Fused(False), "parallel": Parallel, "mixture": Mixture,
          "shared": Shared, "nano": Nano}
