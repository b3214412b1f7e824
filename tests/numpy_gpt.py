"""Independent plain-numpy reference for a nanoGPT-shaped model.

Forward pass plus a hand-derived (manual) backward pass.  No autograd library
and no torch: only numpy and the standard library.  Used as ground truth for
testing ``dtensor``.

Layout follows PyTorch: Linear weights are stored (out_features, in_features)
and a Linear computes ``y = x @ W.T (+ b)``.

Parameter names (``C`` = n_embd, ``H`` = hidden, ``V`` = vocab_size)::

    wte.weight (V, C)                 wpe.weight (block_size, C)
    blocks.{i}.ln1.weight / .bias (C,)
    blocks.{i}.attn.{q,k,v,proj}.weight (C, C)
    blocks.{i}.ln2.weight / .bias (C,)
    blocks.{i}.mlp.fc1.weight (H, C)  blocks.{i}.mlp.fc2.weight (C, H)
    ln_f.weight / .bias (C,)          lm_head.weight (V, C)
    (+ "<linear>.bias" (out_features,) for every Linear when bias=True)

Public API
----------
``gpt_loss_and_grads(params, idx, targets, *, n_head, eps=1e-5, gelu="erf",
ignore_index=-100) -> (loss, logits, grads)``
``init_params(n_layer, n_head, n_embd, vocab_size, block_size, hidden,
bias=False, seed=0, dtype=np.float64) -> params``

Run the self-test with an explicit path (the file name does not match
``test_*.py``)::

    python -m pytest tests/numpy_gpt.py -q
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["gpt_loss_and_grads", "gpt_forward", "init_params"]


# --------------------------------------------------------------------------
# small building blocks (each forward returns a cache used by its backward)
# --------------------------------------------------------------------------

_erf_ufunc = np.frompyfunc(math.erf, 1, 1)


def _erf(x):
    """Exact erf, elementwise, via math.erf (computed in float64, cast back)."""
    return _erf_ufunc(x.astype(np.float64)).astype(np.float64).astype(x.dtype)


def _linear_fwd(x, params, name):
    # x: (..., in) ; W: (out, in) ; y: (..., out)
    y = x @ params[name + ".weight"].T
    b = params.get(name + ".bias")
    if b is not None:
        y = y + b
    return y


def _linear_bwd(dy, x, params, name, grads):
    # dy: (..., out) ; x: (..., in)  ->  dx: (..., in)
    W = params[name + ".weight"]  # (out, in)
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
    x2 = x.reshape(-1, x.shape[-1])  # (N, in)
    grads[name + ".weight"] += dy2.T @ x2  # (out, in)
    if name + ".bias" in params:
        grads[name + ".bias"] += dy2.sum(axis=0)  # (out,)
    return dy @ W  # (..., in)


def _layernorm_fwd(x, w, b, eps):
    # x: (B, T, C)
    mu = x.mean(axis=-1, keepdims=True)  # (B, T, 1)
    xc = x - mu  # (B, T, C)
    var = (xc * xc).mean(axis=-1, keepdims=True)  # (B, T, 1), biased
    rstd = 1.0 / np.sqrt(var + eps)  # (B, T, 1)
    xhat = xc * rstd  # (B, T, C)
    y = xhat * w + b  # (B, T, C)
    return y, (xhat, rstd, w)


def _layernorm_bwd(dy, cache, grads, prefix):
    xhat, rstd, w = cache
    C = xhat.shape[-1]
    grads[prefix + ".weight"] += (dy * xhat).reshape(-1, C).sum(axis=0)  # (C,)
    grads[prefix + ".bias"] += dy.reshape(-1, C).sum(axis=0)  # (C,)
    dxhat = dy * w  # (B, T, C)
    # d/dx of (x - mean) * rstd, with var the population variance
    dx = rstd * (
        dxhat
        - dxhat.mean(axis=-1, keepdims=True)
        - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    )  # (B, T, C)
    return dx


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_COEF = 0.044715


def _gelu_fwd(x, kind):
    if kind == "erf":
        cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))  # Phi(x)
        return x * cdf, (x, cdf)
    if kind == "tanh":
        u = _SQRT_2_OVER_PI * (x + _GELU_TANH_COEF * x * x * x)
        t = np.tanh(u)
        return 0.5 * x * (1.0 + t), (x, t)
    raise ValueError(f"unknown gelu kind {kind!r} (expected 'erf' or 'tanh')")


def _gelu_bwd(dy, cache, kind):
    if kind == "erf":
        x, cdf = cache
        pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)  # phi(x)
        return dy * (cdf + x * pdf)
    x, t = cache  # tanh form
    du_dx = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_COEF * x * x)
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du_dx)


def _split_heads(x, n_head):
    B, T, C = x.shape
    hs = C // n_head
    return x.reshape(B, T, n_head, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)


def _merge_heads(x):
    B, nh, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)  # (B, T, C)


def _attn_fwd(x, params, prefix, n_head):
    # x: (B, T, C)
    B, T, C = x.shape
    if C % n_head != 0:
        raise ValueError(f"n_embd={C} not divisible by n_head={n_head}")
    hs = C // n_head
    scale = 1.0 / math.sqrt(hs)
    q = _split_heads(_linear_fwd(x, params, prefix + ".q"), n_head)  # (B, nh, T, hs)
    k = _split_heads(_linear_fwd(x, params, prefix + ".k"), n_head)  # (B, nh, T, hs)
    v = _split_heads(_linear_fwd(x, params, prefix + ".v"), n_head)  # (B, nh, T, hs)
    s = (q @ k.transpose(0, 1, 3, 2)) * scale  # (B, nh, T, T)
    causal = np.tril(np.ones((T, T), dtype=bool))  # (T, T), True where j <= i
    s = np.where(causal, s, -np.inf)  # (B, nh, T, T)
    s = s - s.max(axis=-1, keepdims=True)  # diagonal is never masked -> finite max
    e = np.exp(s)  # masked entries -> exactly 0
    att = e / e.sum(axis=-1, keepdims=True)  # (B, nh, T, T)
    y = att @ v  # (B, nh, T, hs)
    ym = _merge_heads(y)  # (B, T, C)
    out = _linear_fwd(ym, params, prefix + ".proj")  # (B, T, C)
    return out, (x, q, k, v, att, ym, scale)


def _attn_bwd(dout, cache, params, prefix, n_head, grads):
    x, q, k, v, att, ym, scale = cache
    dym = _linear_bwd(dout, ym, params, prefix + ".proj", grads)  # (B, T, C)
    dy = _split_heads(dym, n_head)  # (B, nh, T, hs)
    datt = dy @ v.transpose(0, 1, 3, 2)  # (B, nh, T, T)
    dv = att.transpose(0, 1, 3, 2) @ dy  # (B, nh, T, hs)
    # softmax backward; masked entries have att == 0 so they get ds == 0
    ds = att * (datt - (datt * att).sum(axis=-1, keepdims=True))  # (B, nh, T, T)
    dq = (ds @ k) * scale  # (B, nh, T, hs)
    dk = (ds.transpose(0, 1, 3, 2) @ q) * scale  # (B, nh, T, hs)
    dx = _linear_bwd(_merge_heads(dq), x, params, prefix + ".q", grads)
    dx = dx + _linear_bwd(_merge_heads(dk), x, params, prefix + ".k", grads)
    dx = dx + _linear_bwd(_merge_heads(dv), x, params, prefix + ".v", grads)
    return dx  # (B, T, C)


def _mlp_fwd(x, params, prefix, gelu):
    h = _linear_fwd(x, params, prefix + ".fc1")  # (B, T, H)
    a, gcache = _gelu_fwd(h, gelu)  # (B, T, H)
    out = _linear_fwd(a, params, prefix + ".fc2")  # (B, T, C)
    return out, (x, a, gcache)


def _mlp_bwd(dout, cache, params, prefix, gelu, grads):
    x, a, gcache = cache
    da = _linear_bwd(dout, a, params, prefix + ".fc2", grads)  # (B, T, H)
    dh = _gelu_bwd(da, gcache, gelu)  # (B, T, H)
    return _linear_bwd(dh, x, params, prefix + ".fc1", grads)  # (B, T, C)


def _n_layer(params):
    n = 0
    while f"blocks.{n}.ln1.weight" in params:
        n += 1
    return n


# --------------------------------------------------------------------------
# full model
# --------------------------------------------------------------------------


def _forward(params, idx, *, n_head, eps, gelu):
    idx = np.asarray(idx)
    if idx.ndim != 2:
        raise ValueError(f"idx must be (B, T), got shape {idx.shape}")
    B, T = idx.shape
    wte = params["wte.weight"]  # (V, C)
    wpe = params["wpe.weight"]  # (block_size, C)
    if T > wpe.shape[0]:
        raise ValueError(f"T={T} exceeds block_size={wpe.shape[0]}")
    x = wte[idx] + wpe[np.arange(T)]  # (B, T, C)
    caches = []
    for i in range(_n_layer(params)):
        p = f"blocks.{i}"
        h1, ln1c = _layernorm_fwd(x, params[p + ".ln1.weight"], params[p + ".ln1.bias"], eps)
        a, attc = _attn_fwd(h1, params, p + ".attn", n_head)
        x = x + a  # (B, T, C)
        h2, ln2c = _layernorm_fwd(x, params[p + ".ln2.weight"], params[p + ".ln2.bias"], eps)
        m, mlpc = _mlp_fwd(h2, params, p + ".mlp", gelu)
        x = x + m  # (B, T, C)
        caches.append((ln1c, attc, ln2c, mlpc))
    xf, lnfc = _layernorm_fwd(x, params["ln_f.weight"], params["ln_f.bias"], eps)  # (B, T, C)
    logits = _linear_fwd(xf, params, "lm_head")  # (B, T, V)
    return logits, (idx, caches, xf, lnfc)


def gpt_forward(params, idx, *, n_head, eps=1e-5, gelu="erf"):
    """Logits (B, T, V) only."""
    return _forward(params, idx, n_head=n_head, eps=eps, gelu=gelu)[0]


def _cross_entropy(logits, targets, ignore_index):
    """Mean CE over positions with target != ignore_index; returns (loss, dlogits)."""
    B, T, V = logits.shape
    lg = logits.reshape(B * T, V)  # (N, V)
    tg = np.asarray(targets).reshape(B * T)  # (N,)
    valid = tg != ignore_index  # (N,)
    n_valid = int(valid.sum())
    safe_t = np.where(valid, tg, 0)  # (N,)
    if np.any((safe_t < 0) | (safe_t >= V)):
        raise ValueError("target out of range [0, vocab_size)")
    z = lg - lg.max(axis=-1, keepdims=True)  # (N, V), stable
    logsumexp = np.log(np.exp(z).sum(axis=-1, keepdims=True))  # (N, 1)
    logp = z - logsumexp  # (N, V), log-softmax
    nll = -logp[np.arange(B * T), safe_t]  # (N,)
    if n_valid == 0:
        # like torch's mean over an empty set: nan loss; gradient taken as 0 here
        return float("nan"), np.zeros_like(logits)
    loss = (nll * valid).sum() / n_valid
    dlg = np.exp(logp)  # softmax, (N, V)
    dlg[np.arange(B * T), safe_t] -= 1.0
    dlg *= (valid / n_valid).astype(logits.dtype)[:, None]
    return float(loss), dlg.reshape(B, T, V)


def gpt_loss_and_grads(params, idx, targets, *, n_head, eps=1e-5, gelu="erf",
                       ignore_index=-100):
    """Forward + manual backward.

    Returns ``(loss, logits, grads)``: ``loss`` a Python float, ``logits``
    (B, T, V) in the params' dtype, ``grads`` a dict with exactly the keys of
    ``params`` (same shapes/dtypes).  With ``targets=None`` returns
    ``(None, logits, None)``.  If every target equals ``ignore_index`` the loss
    is nan (as torch's mean reduction) and the gradients are zero.
    """
    logits, (idx, caches, xf, lnfc) = _forward(params, idx, n_head=n_head, eps=eps, gelu=gelu)
    if targets is None:
        return None, logits, None
    loss, dlogits = _cross_entropy(logits, targets, ignore_index)  # dlogits (B, T, V)

    grads = {k: np.zeros_like(v) for k, v in params.items()}
    dxf = _linear_bwd(dlogits, xf, params, "lm_head", grads)  # (B, T, C)
    dx = _layernorm_bwd(dxf, lnfc, grads, "ln_f")  # (B, T, C)
    for i in reversed(range(len(caches))):
        p = f"blocks.{i}"
        ln1c, attc, ln2c, mlpc = caches[i]
        dh2 = _mlp_bwd(dx, mlpc, params, p + ".mlp", gelu, grads)
        dx = dx + _layernorm_bwd(dh2, ln2c, grads, p + ".ln2")  # residual
        dh1 = _attn_bwd(dx, attc, params, p + ".attn", n_head, grads)
        dx = dx + _layernorm_bwd(dh1, ln1c, grads, p + ".ln1")  # residual
    B, T = idx.shape
    np.add.at(grads["wte.weight"], idx, dx)  # scatter-add into (V, C)
    grads["wpe.weight"][:T] += dx.sum(axis=0)  # (T, C)
    return loss, logits, grads


def init_params(n_layer, n_head, n_embd, vocab_size, block_size, hidden,
                bias=False, seed=0, dtype=np.float64):
    """nanoGPT-style init (convenience for self-tests)."""
    if n_embd % n_head != 0:
        raise ValueError("n_embd must be divisible by n_head")
    rng = np.random.default_rng(seed)
    C, H, V = n_embd, hidden, vocab_size
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * n_layer)

    def normal(shape, s):
        return (rng.standard_normal(shape) * s).astype(dtype)

    p = {"wte.weight": normal((V, C), std), "wpe.weight": normal((block_size, C), std)}

    def linear(name, out_f, in_f, s):
        p[name + ".weight"] = normal((out_f, in_f), s)
        if bias:
            p[name + ".bias"] = np.zeros(out_f, dtype=dtype)

    for i in range(n_layer):
        b = f"blocks.{i}"
        p[b + ".ln1.weight"] = np.ones(C, dtype=dtype)
        p[b + ".ln1.bias"] = np.zeros(C, dtype=dtype)
        for n in ("q", "k", "v"):
            linear(f"{b}.attn.{n}", C, C, std)
        linear(b + ".attn.proj", C, C, proj_std)
        p[b + ".ln2.weight"] = np.ones(C, dtype=dtype)
        p[b + ".ln2.bias"] = np.zeros(C, dtype=dtype)
        linear(b + ".mlp.fc1", H, C, std)
        linear(b + ".mlp.fc2", C, H, proj_std)
    p["ln_f.weight"] = np.ones(C, dtype=dtype)
    p["ln_f.bias"] = np.zeros(C, dtype=dtype)
    linear("lm_head", V, C, std)
    return p


# --------------------------------------------------------------------------
# self-tests
# --------------------------------------------------------------------------

_CFG = dict(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8, hidden=16)


def _test_problem(bias, seed):
    """Tiny problem with O(1) parameters so that gradients are well above FD noise."""
    p = init_params(**_CFG, bias=bias, seed=seed)
    rng = np.random.default_rng(seed + 100)
    for k in p:  # perturb everything (incl. LN weights/biases, Linear biases)
        p[k] = p[k] + rng.standard_normal(p[k].shape) * 0.5
    B, T = 2, 5
    idx = rng.integers(0, _CFG["vocab_size"], size=(B, T))
    targets = rng.integers(0, _CFG["vocab_size"], size=(B, T))
    targets[0, 1] = -100
    targets[1, 3] = -100
    targets[1, 4] = -100
    return p, idx, targets


def _naive_loss(params, idx, targets, n_head, eps, gelu, ignore_index=-100):
    """Loop-based forward (per batch row / head / query), independent of _forward."""
    B, T = idx.shape
    C = params["wte.weight"].shape[1]
    hs = C // n_head

    def lin(v, name):
        out = params[name + ".weight"] @ v
        return out + params[name + ".bias"] if name + ".bias" in params else out

    def ln(v, name):
        m = sum(v) / len(v)
        var = sum((vi - m) ** 2 for vi in v) / len(v)
        return (v - m) / math.sqrt(var + eps) * params[name + ".weight"] + params[name + ".bias"]

    def act(z):
        if gelu == "erf":
            return np.array([0.5 * t * (1 + math.erf(t / math.sqrt(2))) for t in z])
        return np.array([0.5 * t * (1 + math.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))
                         for t in z])

    total, count = 0.0, 0
    for b in range(B):
        xs = [params["wte.weight"][idx[b, t]] + params["wpe.weight"][t] for t in range(T)]
        for i in range(_n_layer(params)):
            pre = f"blocks.{i}"
            hs_ = [ln(x, pre + ".ln1") for x in xs]
            qs = [lin(h, pre + ".attn.q") for h in hs_]
            ks = [lin(h, pre + ".attn.k") for h in hs_]
            vs = [lin(h, pre + ".attn.v") for h in hs_]
            new = []
            for t in range(T):
                y = np.zeros(C)
                for hd in range(n_head):
                    sl = slice(hd * hs, (hd + 1) * hs)
                    sc = [float(qs[t][sl] @ ks[j][sl]) / math.sqrt(hs) for j in range(t + 1)]
                    mx = max(sc)
                    w = [math.exp(s - mx) for s in sc]
                    w = [wi / sum(w) for wi in w]
                    y[sl] = sum(w[j] * vs[j][sl] for j in range(t + 1))
                new.append(xs[t] + lin(y, pre + ".attn.proj"))
            xs = [x + lin(act(lin(ln(x, pre + ".ln2"), pre + ".mlp.fc1")), pre + ".mlp.fc2")
                  for x in new]
        for t in range(T):
            if targets[b, t] == ignore_index:
                continue
            lg = lin(ln(xs[t], "ln_f"), "lm_head")
            total += math.log(sum(math.exp(v) for v in lg)) - lg[targets[b, t]]
            count += 1
    return total / count


def test_reference_matches_finite_differences():
    # 4-point central stencil (error O(h^4)); with h=1e-3 both truncation and
    # round-off stay ~1e-11 absolute, so even ~1e-5-sized gradients meet rel < 1e-6
    n_head, eps_ln, h = _CFG["n_head"], 1e-5, 1e-3
    rng = np.random.default_rng(1234)
    worst, n_checked = 0.0, 0
    for bias in (False, True):
        for gelu in ("erf", "tanh"):
            p, idx, targets = _test_problem(bias, seed=7 if bias else 3)
            loss, logits, grads = gpt_loss_and_grads(p, idx, targets, n_head=n_head,
                                                     eps=eps_ln, gelu=gelu)
            assert logits.shape == (2, 5, _CFG["vocab_size"]) and logits.dtype == np.float64
            assert set(grads) == set(p)
            assert len(p) == 5 + 2 * 10 + (2 * 6 + 1 if bias else 0)
            # forward against a loop-based, independently written forward
            ref = _naive_loss(p, idx, targets, n_head, eps_ln, gelu)
            assert abs(loss - ref) <= 1e-12 * max(1.0, abs(ref)), (loss, ref)

            def f(name, w, j, delta):  # loss with entry j of params[name] shifted
                wd = w.copy()
                wd.reshape(-1)[j] += delta
                q = dict(p)
                q[name] = wd
                lg = gpt_forward(q, idx, n_head=n_head, eps=eps_ln, gelu=gelu)
                return _cross_entropy(lg, targets, -100)[0]

            for name, w in p.items():
                g = grads[name]
                assert g.shape == w.shape and g.dtype == w.dtype
                flat = w.reshape(-1)
                # every entry of (C,)-sized params, else a random subset of 6,
                # plus always the largest-|grad| entry
                n_check = flat.size if flat.size <= 8 else 6
                picks = rng.choice(flat.size, size=n_check, replace=False)
                picks = np.unique(np.append(picks, np.argmax(np.abs(g))))
                for j in picks:
                    num = (8.0 * (f(name, w, j, h) - f(name, w, j, -h))
                           - (f(name, w, j, 2 * h) - f(name, w, j, -2 * h))) / (12.0 * h)
                    n_checked += 1
                    ana = g.reshape(-1)[j]
                    scale = max(abs(num), abs(ana))
                    if scale < 1e-7:
                        # genuinely ~0 entries (e.g. unused wte rows, wpe rows >= T)
                        assert abs(num - ana) < 1e-9, (bias, gelu, name, j, ana, num)
                        continue
                    rel = abs(num - ana) / scale
                    worst = max(worst, rel)
                    assert rel < 1e-6, (bias, gelu, name, j, ana, num, rel)
            # exact zeros where the model cannot depend on a parameter
            unused = np.setdiff1d(np.arange(_CFG["vocab_size"]), idx)
            assert np.all(grads["wte.weight"][unused] == 0)
            assert np.all(grads["wpe.weight"][idx.shape[1]:] == 0)
    print(f"\nFD check: {n_checked} entries, worst relative error {worst:.2e}")


def test_causality_ignore_index_and_float32():
    p, idx, targets = _test_problem(bias=True, seed=5)
    logits = gpt_forward(p, idx, n_head=2)
    idx2 = idx.copy()
    idx2[:, 3:] = (idx2[:, 3:] + 1) % _CFG["vocab_size"]  # change the future only
    logits2 = gpt_forward(p, idx2, n_head=2)
    np.testing.assert_array_equal(logits[:, :3], logits2[:, :3])
    assert np.abs(logits[:, 3:] - logits2[:, 3:]).max() > 1e-3
    l1, lg1, g1 = gpt_loss_and_grads(p, idx, targets, n_head=2)
    # loss is the mean NLL over non-ignored positions only
    lp = lg1 - np.log(np.exp(lg1).sum(-1, keepdims=True))
    m = targets != -100
    assert abs(l1 + lp[m, targets[m]].mean()) < 1e-12
    # a custom ignore_index behaves the same as -100
    t7 = np.where(targets == -100, 7, targets)
    t7[0, 0] = 7  # and another position is now ignored too
    lc, _, gc = gpt_loss_and_grads(p, idx, t7, n_head=2, ignore_index=7)
    m7 = t7 != 7
    assert abs(lc + lp[m7, t7[m7]].mean()) < 1e-12
    # GELU sanity values
    x = np.array([-1.0, 0.0, 1.0])
    np.testing.assert_allclose(_gelu_fwd(x, "erf")[0],
                               [-0.15865525393145707, 0.0, 0.8413447460685429], rtol=1e-15)
    np.testing.assert_allclose(_gelu_fwd(x, "tanh")[0],
                               [-0.15880800939172324, 0.0, 0.8411919906082768], rtol=1e-14)
    # all-ignored -> nan loss, zero grads
    ln, _, gn = gpt_loss_and_grads(p, idx, np.full_like(targets, -100), n_head=2)
    assert math.isnan(ln) and all(np.all(v == 0) for v in gn.values())
    # float32 path stays float32 and agrees with float64
    p32 = {k: v.astype(np.float32) for k, v in p.items()}
    l32, lg32, g32 = gpt_loss_and_grads(p32, idx, targets, n_head=2)
    assert lg32.dtype == np.float32 and all(g32[k].dtype == np.float32 for k in p)
    assert abs(l32 - l1) < 1e-4 * max(1.0, abs(l1))
    for k in p:
        np.testing.assert_allclose(g32[k], g1[k], rtol=2e-3, atol=2e-4 * np.abs(g1[k]).max() + 1e-7,
                                   err_msg=k)
