"""A nanoGPT-shaped Transformer: CausalSelfAttention, MLP, Block, GPT."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dtensor.tensor import arange, as_tensor, rand
from dtensor.autograd import no_grad
from dtensor.nn import functional as F
from dtensor.nn.layers import GELU, Dropout, Embedding, LayerNorm, Linear
from dtensor.nn.module import Module, ModuleList
from dtensor.validate import as_bool, as_int, as_real

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Block", "GPT"]


@dataclass
class GPTConfig:
    block_size: int = 128
    vocab_size: int = 4096
    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 256
    mlp_hidden: int | None = None  # default 4 * n_embd
    dropout: float = 0.0
    bias: bool = False
    gelu: str = "none"  # "none" = exact erf, "tanh" = approximation
    ln_eps: float = 1e-5

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            setattr(self, name, as_int(getattr(self, name), f"GPTConfig: {name}", low=1))
        if self.mlp_hidden is not None:
            self.mlp_hidden = as_int(self.mlp_hidden, "GPTConfig: mlp_hidden", low=1,
                                     fix="Or None for 4 * n_embd.")
        self.dropout = as_real(self.dropout, "GPTConfig: dropout", low=0, high=1)
        self.ln_eps = as_real(self.ln_eps, "GPTConfig: ln_eps", low=0)
        self.bias = as_bool(self.bias, "GPTConfig: bias")
        if self.gelu not in ("none", "tanh"):
            raise ValueError(f"GPTConfig: gelu must be 'none' (exact erf) or 'tanh', got "
                             f"{self.gelu!r}.")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by "
                             f"n_head={self.n_head}.")
        if self.mlp_hidden is None:
            self.mlp_hidden = 4 * self.n_embd


class CausalSelfAttention(Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        C = cfg.n_embd
        self.q = Linear(C, C, bias=cfg.bias)
        self.k = Linear(C, C, bias=cfg.bias)
        self.v = Linear(C, C, bias=cfg.bias)
        self.proj = Linear(C, C, bias=cfg.bias)
        self.resid_dropout = Dropout(cfg.dropout)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout

    def forward(self, x):
        B, T_, C = x.shape
        nh = self.n_head
        # Heads are read from the projection's output width, so the same code runs when q/k/v
        # are column-sharded (each rank then sees a slice of the heads).
        hs = C // nh
        q = self.q(x).reshape(B, T_, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k(x).reshape(B, T_, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v(x).reshape(B, T_, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout,
                                           training=self.training)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T_, -1)  # (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = Linear(cfg.n_embd, cfg.mlp_hidden, bias=cfg.bias)
        self.gelu = GELU(cfg.gelu)
        self.fc2 = Linear(cfg.mlp_hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.fc2(self.gelu(self.fc1(x))))


class Block(Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = LayerNorm(cfg.n_embd, eps=cfg.ln_eps, bias=True)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = LayerNorm(cfg.n_embd, eps=cfg.ln_eps, bias=True)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(Module):
    """GPT with an untied lm_head. ``forward(idx, targets=None) -> (logits, loss)``.

    Init: Linear/Embedding weights N(0, 0.02); proj and fc2 N(0, 0.02/sqrt(2 n_layer)) (GPT-2's
    residual scaling); biases 0; LayerNorm 1/0.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT takes a GPTConfig, got {type(cfg).__name__}; write "
                            f"GPT(GPTConfig(**kwargs)).")
        self.config = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd)
        self.drop = Dropout(cfg.dropout)
        self.blocks = ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, eps=cfg.ln_eps, bias=True)
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        with no_grad():
            for name, m in self.named_modules():
                if isinstance(m, (Linear, Embedding)):
                    residual = name.endswith(("attn.proj", "mlp.fc2"))
                    m.weight.normal_(0.0, 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02)
                if isinstance(m, Linear) and m.bias is not None:
                    m.bias.zero_()

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None):
        idx = token_ids(idx, "GPT", self.config.block_size, "block_size")
        pos = arange(idx.shape[1], dtype=np.int64)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return logits, next_token_loss(logits, idx, targets, "GPT")

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None) -> np.ndarray:
        """Sample continuations of ``idx`` (B, T); draws come from the counter-based RNG.
        ``temperature`` 0 picks the most likely token."""
        return sample(self, idx, max_new_tokens, self.config.block_size, temperature, top_k)


def token_ids(idx, model: str, context: int, context_name: str):
    """A language model's (batch, sequence) input, checked against its context length."""
    idx = as_tensor(idx)
    if idx.ndim != 2:
        raise ValueError(f"{model}: idx must be token ids of shape (batch, sequence), got shape "
                         f"{tuple(idx.shape)}; a single sequence is idx[None].")
    if idx.shape[1] > context:
        raise ValueError(f"{model}: sequence length {idx.shape[1]} exceeds {context_name} "
                         f"{context}.")
    return idx


def next_token_loss(logits, idx, targets, model: str):
    """Mean cross-entropy of (B, T, V) logits against the next tokens (B, T); None without
    targets."""
    if targets is None:
        return None
    targets = as_tensor(targets)
    if tuple(targets.shape) != tuple(idx.shape):  # checked before the flattening
        raise ValueError(f"{model}: targets of shape {tuple(targets.shape)} must match idx of "
                         f"shape {tuple(idx.shape)}: one next token per position.")
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def sample(model, idx, max_new_tokens: int, context: int, temperature: float = 1.0,
           top_k: int | None = None) -> np.ndarray:
    """Autoregressive sampling from any ``model(idx) -> (logits, _)`` that sees at most
    ``context`` tokens; draws come from the counter-based RNG, so every layout samples alike."""
    max_new_tokens = as_int(max_new_tokens, "generate: max_new_tokens", low=0)
    temperature = as_real(temperature, "generate: temperature", low=0)
    if top_k is not None:
        top_k = as_int(top_k, "generate: top_k", low=1, fix="Or None for no cut.")
    idx = np.asarray(as_tensor(idx).numpy())
    with no_grad():
        for _ in range(max_new_tokens):
            logits, _ = model(idx[:, -context:])
            last = logits[:, -1, :]
            last = last.full_tensor() if last.is_distributed else last
            logits = last.numpy().astype(np.float64) / max(temperature, 1e-8)
            if top_k is not None:
                kth = np.sort(logits, axis=-1)[:, -min(top_k, logits.shape[-1])][:, None]
                logits = np.where(logits < kth, -np.inf, logits)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            cdf = np.cumsum(p / p.sum(-1, keepdims=True), axis=-1)
            u = rand(idx.shape[0], 1, dtype=np.float64).numpy()
            nxt = np.minimum((cdf < u).sum(-1), logits.shape[-1] - 1)
            idx = np.concatenate([idx, nxt[:, None]], axis=1)
    return idx
