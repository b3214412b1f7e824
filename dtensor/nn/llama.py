"""A Llama-family decoder (Llama 2/3, and the tiny ones people test with), in one file.

RMSNorm before attention and MLP, rotary position embedding (Hugging Face's ``rotate_half``
layout), grouped-query attention (``n_kv_heads`` key/value heads shared by groups of query
heads), a SwiGLU MLP ``down(silu(gate(x)) * up(x))``, no biases, an untied or tied ``lm_head``.
Module names follow Hugging Face's ``LlamaForCausalLM`` without its ``model.`` prefix, so a
checkpoint maps onto the parameters name for name; ``from_pretrained`` / ``save_pretrained``
read and write that layout.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from dtensor.nn import functional as F
from dtensor.nn import init
from dtensor.nn.gpt import next_token_loss, sample, token_ids
from dtensor.nn.hf import NameMap, load_safetensors, save_safetensors
from dtensor.nn.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from dtensor.nn.module import Module, ModuleList
from dtensor.tensor import arange
from dtensor.validate import as_bool, as_int, as_real

__all__ = ["LlamaConfig", "Llama", "LlamaAttention", "LlamaMLP", "LlamaDecoderLayer"]


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 256               # hidden_size
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: n_heads (plain multi-head attention)
    hidden_dim: int | None = None  # the MLP's width (intermediate_size); None: 4 * dim
    head_dim: int | None = None    # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            setattr(self, name, as_int(getattr(self, name), f"LlamaConfig: {name}", low=1))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self.n_kv_heads = as_int(self.n_kv_heads, "LlamaConfig: n_kv_heads", low=1)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_kv_heads={self.n_kv_heads} must divide n_heads="
                             f"{self.n_heads} (each key/value head serves a whole group of "
                             f"query heads).")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"LlamaConfig: dim={self.dim} is not divisible by n_heads="
                                 f"{self.n_heads}; set head_dim explicitly.")
            self.head_dim = self.dim // self.n_heads
        self.head_dim = as_int(self.head_dim, "LlamaConfig: head_dim", low=2)
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even (rotary "
                             f"embedding rotates pairs).")
        if self.hidden_dim is None:
            self.hidden_dim = 4 * self.dim
        self.hidden_dim = as_int(self.hidden_dim, "LlamaConfig: hidden_dim", low=1)
        self.norm_eps = as_real(self.norm_eps, "LlamaConfig: norm_eps", low=0)
        self.rope_theta = as_real(self.rope_theta, "LlamaConfig: rope_theta", low=0)
        self.init_std = as_real(self.init_std, "LlamaConfig: init_std", low=0)
        self.tie_embeddings = as_bool(self.tie_embeddings, "LlamaConfig: tie_embeddings")

    # -- Hugging Face config.json
    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """Read a Hugging Face ``config.json`` dict; a field this model does not implement (or
        implements only for some values) is a ValueError naming it."""
        if not isinstance(hf, dict):
            raise TypeError(f"config.json must hold a JSON object, got {type(hf).__name__}.")
        unknown = [k for k in hf if k not in _HF_FIELDS and k not in _HF_CHECKED
                   and k not in _HF_METADATA and not k.startswith("_")]
        if unknown:
            raise ValueError(f"config.json: field(s) {unknown} are not supported by "
                             f"dtensor.nn.Llama (it implements: {sorted(_HF_FIELDS)}, with "
                             f"{sorted(_HF_CHECKED)} at their Llama defaults).")
        for key, (ok, why) in _HF_CHECKED.items():
            if key in hf and not ok(hf[key]):
                raise ValueError(f"config.json: {key}={hf[key]!r} is not supported by "
                                 f"dtensor.nn.Llama ({why}).")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json is missing {missing}, which a Llama config needs.")
        kwargs = {ours: hf[theirs] for theirs, ours in _HF_FIELDS.items()
                  if theirs in hf and hf[theirs] is not None}
        rope = hf.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        return cls(**kwargs)

    def to_hf(self) -> dict:
        hf = {theirs: getattr(self, ours) for theirs, ours in _HF_FIELDS.items()}
        hf.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  attention_bias=False, mlp_bias=False, rope_scaling=None,
                  torch_dtype="float32")
        return hf


# Hugging Face name -> LlamaConfig field.
_HF_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
              "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
              "intermediate_size": "hidden_dim", "head_dim": "head_dim",
              "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta",
              "max_position_embeddings": "max_seq_len",
              "tie_word_embeddings": "tie_embeddings", "initializer_range": "init_std"}
# Fields that change the computation: accepted at the values this model implements, and why.
_HF_CHECKED = {
    "hidden_act": (lambda v: v == "silu", "the MLP is SwiGLU with silu"),
    "attention_bias": (lambda v: v is False, "projections have no bias"),
    "mlp_bias": (lambda v: v is False, "projections have no bias"),
    "rope_scaling": (lambda v: v is None,
                     "only the plain rotary embedding is implemented; no scaled variants"),
    "rope_parameters": (lambda v: v is None or (isinstance(v, dict) and v.get(
        "rope_type", "default") == "default" and set(v) <= {"rope_type", "rope_theta"}),
        "only rope_type 'default' (with rope_theta) is implemented"),
    "pretraining_tp": (lambda v: v == 1, "pretraining_tp > 1 splits the projections differently"),
    "attention_dropout": (lambda v: v == 0, "attention has no dropout"),
    "model_type": (lambda v: v == "llama", "this is a Llama"),
}
# Fields with no effect on the computation.
_HF_METADATA = {"architectures", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
                "dtype", "transformers_version", "use_cache", "return_dict",
                "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16",
                "tie_encoder_decoder", "is_encoder_decoder", "id2label", "label2id",
                "name_or_path"}


class LlamaAttention(Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hd = cfg.head_dim
        self.q_proj = Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.k_proj = Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.v_proj = Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.o_proj = Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.head_dim = hd

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        hd = self.head_dim
        # -1 heads: the same code runs when the projections are column-sharded.
        q = self.q_proj(x).view(B, T, -1, hd).transpose(1, 2)  # (B, n_heads, T, hd)
        k = self.k_proj(x).view(B, T, -1, hd).transpose(1, 2)  # (B, n_kv_heads, T, hd)
        v = self.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(Module):
    """``forward(idx, targets=None) -> (logits, loss)``, as GPT: ``targets`` are the next tokens
    (already shifted), the loss their mean cross-entropy.

    Init (as Hugging Face's): every Linear and the embedding N(0, init_std), norms 1.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"Llama takes a LlamaConfig, got {type(cfg).__name__}; write "
                            f"Llama(LlamaConfig(**kwargs)).")
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        for m in self.modules():
            if isinstance(m, (Linear, Embedding)):
                init.normal_(m.weight, 0.0, cfg.init_std)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed_tokens.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None):
        idx = token_ids(idx, "Llama", self.config.max_seq_len, "max_seq_len")
        x = self.embed_tokens(idx)
        cos, sin = self.rotary.cos_sin(arange(idx.shape[1], dtype=np.int64))
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return logits, next_token_loss(logits, idx, targets, "Llama")

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None) -> np.ndarray:
        """Sample continuations of ``idx`` (B, T), as GPT.generate."""
        return sample(self, idx, max_new_tokens, self.config.max_seq_len, temperature, top_k)

    # -- Hugging Face checkpoints
    @classmethod
    def from_pretrained(cls, folder, layout=None, **distributed) -> "Llama":
        """A Llama with the weights of a Hugging Face folder (``config.json`` and
        ``*.safetensors``, names such as ``model.layers.0.self_attn.q_proj.weight``).

        ``layout(model)``, when given, lays out the still-empty model (``parallelize``) before
        the weights load, so each rank reads only its own slice of each tensor.
        ``dtensor.parallel.from_pretrained(Llama, folder, mesh)`` passes it.
        """
        if distributed or (layout is not None and not callable(layout)):
            raise TypeError(
                f"Llama.from_pretrained(folder) loads on one process; for a mesh write "
                f"dtensor.parallel.from_pretrained(Llama, folder, mesh, ...), which lays the "
                f"model out first so each rank reads only its slices (got "
                f"{', '.join(sorted(distributed)) or repr(layout)}).")
        folder = os.fspath(folder)
        path = os.path.join(folder, "config.json")
        try:
            with open(path) as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"Llama.from_pretrained: no config.json in {folder!r}; a "
                                    f"Hugging Face model folder holds config.json and "
                                    f"*.safetensors.") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"Llama.from_pretrained: {path} is not valid JSON ({e}).") from None
        cfg = LlamaConfig.from_hf(hf)
        with init.empty_parameters():
            model = cls(cfg)
        if layout is not None:
            layout(model)
        load_safetensors(model, folder, _HF_NAMES)  # allocates each rank's blocks as it reads
        return model

    def save_pretrained(self, folder) -> None:
        """Write ``config.json`` and ``model.safetensors`` (whole tensors, from any layout; every
        rank must call it, rank 0 writes)."""
        save_safetensors(self, folder, _HF_NAMES, config=self.config.to_hf())


def _hf_to_ours(name: str) -> str | None:
    """Our parameter path for a Hugging Face tensor name (None: a buffer we recompute)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return name.removeprefix("model.")


def _ours_to_hf(path: str) -> str:
    return path if path.startswith("lm_head.") else "model." + path


_HF_NAMES = NameMap(_hf_to_ours, _ours_to_hf)
