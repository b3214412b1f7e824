"""The GPT model against the independent plain-numpy implementation in tests/numpy_gpt.py."""
from __future__ import annotations

import numpy as np
import pytest

import dtensor
from numpy_gpt import gpt_loss_and_grads

CFG = dict(block_size=16, vocab_size=37, n_layer=2, n_head=4, n_embd=32, mlp_hidden=64)


def make(dtype, gelu="none", bias=False):
    dtensor.manual_seed(0)
    model = dtensor.nn.GPT(dtensor.nn.GPTConfig(**CFG, gelu=gelu, bias=bias))
    for p in model.parameters():
        p.data = (p.data + 0.05 * np.random.default_rng(p.numel()).standard_normal(p.shape)
                  ).astype(dtype)  # move LayerNorm/bias off 1/0 so their gradients are tested
    return model


def batch(B=3, T=16, ignore=True):
    rng = np.random.default_rng(5)
    idx = rng.integers(0, CFG["vocab_size"], (B, T))
    tgt = rng.integers(0, CFG["vocab_size"], (B, T))
    if ignore:
        tgt[0, :3] = -100
    return idx, tgt


@pytest.mark.parametrize("gelu,bias", [("none", False), ("tanh", True)])
def test_forward_backward_float64_matches_reference(gelu, bias):
    model = make(np.float64, gelu, bias)
    idx, tgt = batch()
    logits, loss = model(idx, tgt)
    loss.backward()
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    ref_loss, ref_logits, ref_grads = gpt_loss_and_grads(
        params, idx, tgt, n_head=CFG["n_head"], gelu="erf" if gelu == "none" else "tanh")
    # erf/GELU are polynomial fits good to ~1.5e-7, the only source of difference in float64.
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-7)
    np.testing.assert_allclose(logits.numpy(), ref_logits, rtol=1e-6, atol=1e-7)
    for name, p in model.named_parameters():
        scale = np.abs(ref_grads[name]).max()
        np.testing.assert_allclose(p.grad.numpy(), ref_grads[name], atol=1e-6 * scale + 1e-12,
                                   err_msg=name)


def test_forward_backward_float32_matches_reference():
    model = make(np.float32)
    idx, tgt = batch()
    logits, loss = model(idx, tgt)
    loss.backward()
    assert logits.dtype == np.float32 and loss.dtype == np.float32
    params64 = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    ref_loss, ref_logits, ref_grads = gpt_loss_and_grads(params64, idx, tgt,
                                                         n_head=CFG["n_head"])
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=2e-6)
    np.testing.assert_allclose(logits.numpy(), ref_logits, rtol=1e-4, atol=2e-5)
    for name, p in model.named_parameters():
        assert p.grad.dtype == np.float32
        scale = np.abs(ref_grads[name]).max()
        np.testing.assert_allclose(p.grad.numpy(), ref_grads[name], atol=2e-4 * scale,
                                   err_msg=name)


def test_standard_shapes_and_param_count():
    cfg = dtensor.nn.GPTConfig(vocab_size=4096, n_layer=4, n_head=8, n_embd=256, block_size=128)
    model = dtensor.nn.GPT(cfg)
    # The count: 4,198,912 non-embedding parameters (lm_head included, untied).
    assert model.num_params(non_embedding=True) == 4_198_912
    names = [n for n, _ in model.named_parameters()]
    assert "blocks.3.attn.q.weight" in names and "blocks.0.mlp.fc2.weight" in names
    assert not any(n.endswith(("q.bias", "fc1.bias")) for n in names)
    std = model.blocks[0].attn.proj.weight.numpy().std()
    assert abs(std - 0.02 / np.sqrt(8)) < 0.001
    assert abs(model.blocks[0].attn.q.weight.numpy().std() - 0.02) < 0.001


def test_training_reduces_loss_and_generate_is_deterministic():
    model = make(np.float32)
    opt = dtensor.optim.AdamW(model.parameters(), lr=1e-2)
    idx, tgt = batch(ignore=False)
    first = None
    for _ in range(30):
        _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = loss.item() if first is None else first
    assert loss.item() < 0.3 * first
    dtensor.manual_seed(9)
    a = model.generate(idx[:1, :4], 6, top_k=5)
    dtensor.manual_seed(9)
    b = model.generate(idx[:1, :4], 6, top_k=5)
    assert a.shape == (1, 10) and np.array_equal(a, b)


def test_sequence_longer_than_block_size_is_rejected():
    model = make(np.float32)
    with pytest.raises(ValueError, match="17 exceeds block_size 16"):
        model(np.zeros((1, 17), np.int64))
