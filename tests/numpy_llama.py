"""Independent plain-numpy reference for a Hugging Face Llama (``LlamaForCausalLM``), forward
only, written from the Hugging Face modelling code's formulas (not from dtensor's): RMSNorm in
float32-or-wider with the weight applied after, rotary embedding with ``rotate_half``,
``repeat_kv`` for grouped-query attention, causal softmax attention, SwiGLU MLP.

Parameters use Hugging Face's names (``model.layers.0.self_attn.q_proj.weight`` ...), so a dict
of them is also what a checkpoint holds. Gradients for tests come from central differences of
this forward in float64.
"""
from __future__ import annotations

import numpy as np


def rms_norm(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def rope(T, head_dim, theta):
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1)
    return np.cos(emb), np.sin(emb)


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def forward(params: dict, idx, cfg: dict):
    """Logits (B, T, V) for token ids ``idx``; ``cfg`` holds the Hugging Face config fields."""
    P = params
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"]
    hd = cfg.get("head_dim") or D // H
    eps = cfg["rms_norm_eps"]
    B, T = idx.shape
    x = P["model.embed_tokens.weight"][idx]
    cos, sin = rope(T, hd, cfg["rope_theta"])
    causal = np.tril(np.ones((T, T), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, P[p + "input_layernorm.weight"], eps)
        q = (h @ P[p + "self_attn.q_proj.weight"].T).reshape(B, T, H, hd).transpose(0, 2, 1, 3)
        k = (h @ P[p + "self_attn.k_proj.weight"].T).reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
        v = (h @ P[p + "self_attn.v_proj.weight"].T).reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, H // Hkv, axis=1)  # repeat_kv: head j serves query heads j*g .. j*g+g-1
        v = np.repeat(v, H // Hkv, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        y = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, H * hd)
        x = x + y @ P[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
        g = h @ P[p + "mlp.gate_proj.weight"].T
        u = h @ P[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ P[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, P["model.norm.weight"], eps)
    head = P.get("lm_head.weight", P["model.embed_tokens.weight"])
    return x @ head.T


def loss(params: dict, idx, targets, cfg: dict) -> float:
    logits = forward(params, idx, cfg)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], -1).mean())


def random_params(cfg: dict, seed: int, std: float = 0.05) -> dict:
    """A random checkpoint in Hugging Face's names and shapes (float32)."""
    rng = np.random.default_rng(seed)
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = cfg.get("head_dim") or D // H
    F, V = cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,),
                       p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (H * hd, D),
                       p + "self_attn.k_proj.weight": (Hkv * hd, D),
                       p + "self_attn.v_proj.weight": (Hkv * hd, D),
                       p + "self_attn.o_proj.weight": (D, H * hd),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (V, D)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return out


def adamw_losses(params: dict, batches, cfg: dict, lr: float, steps: int,
                 weight_decay: float = 0.01, betas=(0.9, 0.999), eps: float = 1e-8) -> list:
    """Losses of ``steps`` AdamW steps (PyTorch's update) in float64, gradients by central
    differences: an independent loss curve for a tiny model."""
    P = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in P.items()}
    v2 = {k: np.zeros_like(v) for k, v in P.items()}
    losses = []
    for t in range(1, steps + 1):
        idx, tgt = batches[(t - 1) % len(batches)]
        losses.append(loss(P, idx, tgt, cfg))
        grads = {k: _fd_grad(P, k, idx, tgt, cfg) for k in P}  # all at this step's point
        for k, g in grads.items():
            P[k] *= 1 - lr * weight_decay
            m[k] = betas[0] * m[k] + (1 - betas[0]) * g
            v2[k] = betas[1] * v2[k] + (1 - betas[1]) * g * g
            mh = m[k] / (1 - betas[0] ** t)
            vh = v2[k] / (1 - betas[1] ** t)
            P[k] -= lr * mh / (np.sqrt(vh) + eps)
    return losses


def _fd_grad(P, k, idx, tgt, cfg, h=1e-6):
    g = np.zeros_like(P[k])
    flat, gf = P[k].reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = loss(P, idx, tgt, cfg)
        flat[i] = old - h
        down = loss(P, idx, tgt, cfg)
        flat[i] = old
        gf[i] = (up - down) / (2 * h)
    return g
