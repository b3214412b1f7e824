"""Independent plain-numpy reference for a Hugging Face Llama (``LlamaForCausalLM``), forward and
backward, written from the Hugging Face modelling code's formulas (not from dtensor's): RMSNorm
in float32-or-wider with the weight applied after, rotary embedding with ``rotate_half``,
``repeat_kv`` for grouped-query attention, causal softmax attention, SwiGLU MLP.

Parameters use Hugging Face's names (``model.layers.0.self_attn.q_proj.weight`` ...), so a dict
of them is also what a checkpoint holds. ``loss_and_grads`` adds a hand-derived backward (no
autograd library); the self-tests below check it against central differences (``_fd_grad``) of
this forward in float64::

    python -m pytest tests/numpy_llama.py -q
"""
from __future__ import annotations

import numpy as np


def _rms_norm(x, w, eps):
    rms = np.sqrt((x * x).mean(-1, keepdims=True) + eps)  # (B, T, 1)
    n = x / rms
    return w * n, (n, rms, w)


def _rms_norm_bwd(dy, cache):
    """(dx, dw) of y = w * n, n = x / rms, rms = (mean(x^2) + eps)^1/2: since
    d rms / dx = x / (D rms), dx = (dn - n * mean(dn * n)) / rms with dn = dy * w."""
    n, rms, w = cache
    dn = dy * w
    dx = (dn - n * (dn * n).mean(-1, keepdims=True)) / rms
    return dx, (dy * n).reshape(-1, n.shape[-1]).sum(0)


def rope(T, head_dim, theta):
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1)
    return np.cos(emb), np.sin(emb)


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def _rope_bwd(dy, cos, sin):
    # y = x * cos + R x * sin with R = rotate_half, a linear map with R^T = -R (a quarter turn
    # of each (i, i + hd/2) pair), so dx = dy * cos + R^T (dy * sin) = dy * cos - R (dy * sin).
    return dy * cos - rotate_half(dy * sin)


def _linear_bwd(dy, x, W, grads, name):
    # y = x @ W.T, W (out, in): dW = dy^T x summed over every leading dim; dx = dy @ W.
    grads[name] += dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    return dy @ W


def _dims(cfg):
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    return H, Hkv, cfg.get("head_dim") or D // H


def _forward(P, idx, cfg):
    """Logits (B, T, V) and what the backward needs of each layer."""
    H, Hkv, hd = _dims(cfg)
    eps = cfg["rms_norm_eps"]
    B, T = idx.shape
    x = P["model.embed_tokens.weight"][idx]  # (B, T, D)
    cos, sin = rope(T, hd, cfg["rope_theta"])  # (T, hd)
    causal = np.tril(np.ones((T, T), bool))
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h, n1 = _rms_norm(x, P[p + "input_layernorm.weight"], eps)
        q = (h @ P[p + "self_attn.q_proj.weight"].T).reshape(B, T, H, hd).transpose(0, 2, 1, 3)
        k = (h @ P[p + "self_attn.k_proj.weight"].T).reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
        v = (h @ P[p + "self_attn.v_proj.weight"].T).reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
        q = q * cos + rotate_half(q) * sin  # (B, H, T, hd)
        k = k * cos + rotate_half(k) * sin  # (B, Hkv, T, hd)
        k = np.repeat(k, H // Hkv, axis=1)  # repeat_kv: head j serves query heads j*g .. j*g+g-1
        v = np.repeat(v, H // Hkv, axis=1)  # (B, H, T, hd)
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)  # (B, H, T, T)
        s = np.where(causal, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        y = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, H * hd)
        x = x + y @ P[p + "self_attn.o_proj.weight"].T
        h2, n2 = _rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
        g = h2 @ P[p + "mlp.gate_proj.weight"].T  # (B, T, F)
        u = h2 @ P[p + "mlp.up_proj.weight"].T
        m = g / (1 + np.exp(-g)) * u
        x = x + m @ P[p + "mlp.down_proj.weight"].T
        layers.append((h, n1, q, k, v, a, y, h2, n2, g, u, m))
    xf, nf = _rms_norm(x, P["model.norm.weight"], eps)
    head = P.get("lm_head.weight", P["model.embed_tokens.weight"])
    return xf @ head.T, (layers, xf, nf, cos, sin)


def forward(params: dict, idx, cfg: dict):
    """Logits (B, T, V) for token ids ``idx``; ``cfg`` holds the Hugging Face config fields."""
    return _forward(params, idx, cfg)[0]


def _cross_entropy(logits, targets):
    """Mean cross-entropy over every position and its gradient: (softmax - onehot) / (B * T)."""
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))  # (B, T, V)
    onehot = np.arange(logits.shape[-1]) == targets[..., None]
    value = float(-np.take_along_axis(logp, targets[..., None], -1).mean())
    return value, (np.exp(logp) - onehot) / targets.size


def loss(params: dict, idx, targets, cfg: dict) -> float:
    return _cross_entropy(forward(params, idx, cfg), targets)[0]


def loss_and_grads(params: dict, idx, targets, cfg: dict):
    """Mean cross-entropy and its gradient for every parameter (a dict of the same names and
    shapes), by a hand-derived backward of ``forward``; a tied head's two uses of
    ``model.embed_tokens.weight`` (lookup and projection) add into one gradient."""
    P = params
    H, Hkv, hd = _dims(cfg)
    B, T = idx.shape
    logits, (layers, xf, nf, cos, sin) = _forward(P, idx, cfg)
    value, dlogits = _cross_entropy(logits, targets)  # dlogits (B, T, V)
    grads = {k: np.zeros_like(v) for k, v in P.items()}
    head = "lm_head.weight" if "lm_head.weight" in P else "model.embed_tokens.weight"
    dx, dw = _rms_norm_bwd(_linear_bwd(dlogits, xf, P[head], grads, head), nf)
    grads["model.norm.weight"] += dw
    for i in reversed(range(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        h, n1, q, k, v, a, y, h2, n2, g, u, m = layers[i]
        # SwiGLU: m = silu(g) * u, silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
        dm = _linear_bwd(dx, m, P[p + "mlp.down_proj.weight"], grads, p + "mlp.down_proj.weight")
        sig = 1 / (1 + np.exp(-g))
        dg = dm * u * sig * (1 + g * (1 - sig))
        dh2 = _linear_bwd(dg, h2, P[p + "mlp.gate_proj.weight"], grads, p + "mlp.gate_proj.weight")
        dh2 = dh2 + _linear_bwd(dm * g * sig, h2, P[p + "mlp.up_proj.weight"], grads,
                                p + "mlp.up_proj.weight")
        dx2, dw = _rms_norm_bwd(dh2, n2)
        grads[p + "post_attention_layernorm.weight"] += dw
        dx = dx + dx2  # residual
        dy = _linear_bwd(dx, y, P[p + "self_attn.o_proj.weight"], grads,
                         p + "self_attn.o_proj.weight")
        dy = dy.reshape(B, T, H, hd).transpose(0, 2, 1, 3)  # (B, H, T, hd)
        da = dy @ v.transpose(0, 1, 3, 2)  # (B, H, T, T)
        dv = a.transpose(0, 1, 3, 2) @ dy  # (B, H, T, hd)
        # softmax backward; masked entries have a == 0, so they get ds == 0
        ds = a * (da - (da * a).sum(-1, keepdims=True)) / np.sqrt(hd)
        dq = ds @ k  # (B, H, T, hd)
        dk = ds.transpose(0, 1, 3, 2) @ q
        # np.repeat's adjoint: kv head j sums the gradients of the query heads it served
        dk = dk.reshape(B, Hkv, H // Hkv, T, hd).sum(2)  # (B, Hkv, T, hd)
        dv = dv.reshape(B, Hkv, H // Hkv, T, hd).sum(2)
        dq, dk = _rope_bwd(dq, cos, sin), _rope_bwd(dk, cos, sin)
        dh = 0
        for name, d in (("q", dq), ("k", dk), ("v", dv)):
            w = p + f"self_attn.{name}_proj.weight"
            d = d.transpose(0, 2, 1, 3).reshape(B, T, -1)  # (B, T, heads * hd)
            dh = dh + _linear_bwd(d, h, P[w], grads, w)
        dx1, dw = _rms_norm_bwd(dh, n1)
        grads[p + "input_layernorm.weight"] += dw
        dx = dx + dx1  # residual
    np.add.at(grads["model.embed_tokens.weight"], idx, dx)  # scatter-add into (V, D)
    return value, grads


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
    """Losses of ``steps`` AdamW steps (PyTorch's update) in float64, gradients from
    ``loss_and_grads``: an independent loss curve for a tiny model."""
    P = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in P.items()}
    v2 = {k: np.zeros_like(v) for k, v in P.items()}
    losses = []
    for t in range(1, steps + 1):
        idx, tgt = batches[(t - 1) % len(batches)]
        value, grads = loss_and_grads(P, idx, tgt, cfg)
        losses.append(value)
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


# --------------------------------------------------------------------------
# self-tests
# --------------------------------------------------------------------------

# Multi-head with an untied head; grouped-query (2 kv heads serving 4 query heads) with a tied
# head and head_dim != hidden_size / num_attention_heads.
_CFGS = {
    "mha": dict(vocab_size=11, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=False),
    "gqa": dict(vocab_size=13, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=6, rms_norm_eps=1e-6,
                rope_theta=500000.0, tie_word_embeddings=True),
}


def _problem(kind, seed=0, B=2, T=5):
    cfg = _CFGS[kind]
    # std 0.3: attention far from uniform and O(1) activations, so every term is exercised
    P = {k: v.astype(np.float64) for k, v in random_params(cfg, seed, std=0.3).items()}
    rng = np.random.default_rng(seed + 1)
    idx, tgt = (rng.integers(0, cfg["vocab_size"], (B, T)) for _ in range(2))
    return cfg, P, idx, tgt


def test_loss_and_grads_match_central_differences():
    for kind in _CFGS:
        cfg, P, idx, tgt = _problem(kind)
        assert ("lm_head.weight" in P) is not cfg["tie_word_embeddings"]
        value, grads = loss_and_grads(P, idx, tgt, cfg)
        assert value == loss(P, idx, tgt, cfg)
        assert set(grads) == set(P)
        for name in P:
            fd = _fd_grad(P, name, idx, tgt, cfg)
            assert grads[name].shape == fd.shape and grads[name].dtype == np.float64
            # central differences at h=1e-6 carry ~1e-10 of round-off: judge against the scale
            err = np.abs(grads[name] - fd).max() / np.abs(fd).max()
            assert err < 1e-6, (kind, name, err)


def test_tied_head_gradient_is_lookup_plus_projection():
    # Untie the gqa problem's head as a copy of the embedding: the same function of the same
    # values, so the tied gradient must be the sum of the two untied ones.
    cfg, P, idx, tgt = _problem("gqa", seed=3)
    untied = dict(P, **{"lm_head.weight": P["model.embed_tokens.weight"].copy()})
    _, tied = loss_and_grads(P, idx, tgt, cfg)
    _, split = loss_and_grads(untied, idx, tgt, cfg)
    np.testing.assert_allclose(tied["model.embed_tokens.weight"],
                               split["model.embed_tokens.weight"] + split["lm_head.weight"],
                               rtol=1e-12, atol=1e-15)
    for name in P:
        if name != "model.embed_tokens.weight":
            np.testing.assert_allclose(tied[name], split[name], rtol=1e-12, atol=1e-15)
