"""dtensor.nn.Llama against the independent numpy reference (tests/numpy_llama.py): a checkpoint
written here with safetensors in Hugging Face's names, loaded with Llama.from_pretrained; values,
gradients, an 8-step AdamW loss curve, and every parallel layout against the one-process run."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import dtensor
import numpy_llama as ref
from dtensor import DTensor
from dtensor.nn import Llama, LlamaConfig
from dtensor.nn.hf import HFCheckpointError

# Two shapes: multi-head with an untied head, and grouped-query (2 kv heads for 4 query heads,
# the tp 4 > n_kv_heads case) with a tied head and head_dim != dim / n_heads.
HF = {
    "mha": dict(vocab_size=20, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
                rope_theta=10000.0, max_position_embeddings=16, tie_word_embeddings=False,
                hidden_act="silu", model_type="llama", architectures=["LlamaForCausalLM"],
                torch_dtype="float32", attention_bias=False, mlp_bias=False, rope_scaling=None),
    "gqa": dict(vocab_size=24, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-6,
                rope_theta=500000.0, max_position_embeddings=16, tie_word_embeddings=True,
                hidden_act="silu", model_type="llama", bos_token_id=1, eos_token_id=2,
                initializer_range=0.02, use_cache=True, transformers_version="4.46.0"),
}


def _checkpoint(tmp_path, kind, seed=0, **extra):
    cfg = dict(HF[kind], **extra)
    params = ref.random_params(cfg, seed, std=0.3)
    folder = tmp_path / kind
    folder.mkdir(exist_ok=True)
    save_file(params, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, cfg, params


def _batches(cfg, n=2, B=4, T=8, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, cfg["vocab_size"], (B, T)),
             rng.integers(0, cfg["vocab_size"], (B, T))) for _ in range(n)]


def _whole(t):
    return t.full_tensor().numpy() if isinstance(t, DTensor) else t.numpy()


@pytest.mark.parametrize("kind", sorted(HF))
def test_logits_match_the_reference(tmp_path, kind):
    folder, cfg, params = _checkpoint(tmp_path, kind)
    model = Llama.from_pretrained(folder)
    idx, tgt = _batches(cfg)[0]
    logits, loss = model(idx, tgt)
    want = ref.forward({k: v.astype(np.float64) for k, v in params.items()}, idx, cfg)
    # float32 through 2 layers of O(1) activations: a few ulps of the largest logit per op.
    np.testing.assert_allclose(logits.numpy(), want, rtol=0, atol=2e-5 * np.abs(want).max())
    assert abs(loss.item() - ref.loss(params, idx, tgt, cfg)) < 1e-5


@pytest.mark.parametrize("kind", sorted(HF))
def test_gradients_match_finite_differences(tmp_path, kind):
    folder, cfg, params = _checkpoint(tmp_path, kind)
    model = Llama.from_pretrained(folder)
    idx, tgt = _batches(cfg)[0]
    model(idx, tgt)[1].backward()
    P = {k: v.astype(np.float64) for k, v in params.items()}
    ours = dict(model.named_parameters())
    for name in P:
        path = name.removeprefix("model.")
        g = ours[path].grad.numpy()
        fd = ref._fd_grad(P, name, idx, tgt, cfg)
        # float32 backward vs float64 central differences: relative to the gradient's scale.
        np.testing.assert_allclose(g, fd, rtol=0, atol=1e-4 * max(np.abs(fd).max(), 1e-3),
                                   err_msg=name)


def _adamw_losses(model, batches, steps=8, lr=3e-3, layout=None):
    opt = dtensor.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for t in range(steps):
        idx, tgt = batches[t % len(batches)]
        _, loss = model(idx, tgt)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


@pytest.mark.parametrize("kind", sorted(HF))
def test_adamw_curve_matches_the_independent_one(tmp_path, kind):
    folder, cfg, params = _checkpoint(tmp_path, kind)
    batches = _batches(cfg)
    want = ref.adamw_losses(params, batches, cfg, lr=3e-3, steps=8)
    got = _adamw_losses(Llama.from_pretrained(folder), batches)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_save_pretrained_round_trips(tmp_path):
    folder, cfg, params = _checkpoint(tmp_path, "gqa")
    model = Llama.from_pretrained(folder)
    model.save_pretrained(tmp_path / "out")
    again = Llama.from_pretrained(tmp_path / "out")
    for (n, p), (m, q) in zip(model.named_parameters(), again.named_parameters()):
        assert n == m and np.array_equal(p.numpy(), q.numpy())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert LlamaConfig.from_hf(written) == model.config
    # tied: the head is the embedding, saved once under Hugging Face's name
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()


@pytest.mark.parametrize("change, error, words", [
    (dict(hidden_act="gelu"), ValueError, "hidden_act='gelu'"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), ValueError, "rope_scaling"),
    (dict(attention_bias=True), ValueError, "attention_bias"),
    (dict(sliding_window=4096), ValueError, "sliding_window"),
    (dict(model_type="mistral"), ValueError, "model_type"),
    (dict(num_key_value_heads=3), ValueError, "n_kv_heads=3"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), ValueError, "rope_parameters"),
])
def test_unsupported_config_fields_are_named(tmp_path, change, error, words):
    folder, _, _ = _checkpoint(tmp_path, "mha")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error, match=words.replace("(", r"\(").replace("[", r"\[")):
        Llama.from_pretrained(folder)


def test_checkpoint_mismatches_are_named(tmp_path):
    folder, cfg, params = _checkpoint(tmp_path, "mha")
    bad = dict(params)
    bad["model.layers.0.mlp.gate_proj.weight"] = bad["model.layers.0.mlp.gate_proj.weight"][:5]
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="gate_proj"):
        Llama.from_pretrained(folder)
    del bad["model.layers.0.mlp.gate_proj.weight"]
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="gate_proj"):
        Llama.from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="config.json"):
        Llama.from_pretrained(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- layouts


def _shared_checkpoint(tmp_path, kind, comm, tied=False):
    """One checkpoint folder for every rank (tmp_path is the same path on every rank; rank 0
    writes, the others wait); the head untied unless ``tied``."""
    if comm.rank == 0:
        _checkpoint(tmp_path, kind, tie_word_embeddings=tied)
    comm.barrier()
    return tmp_path / kind, dict(HF[kind], tie_word_embeddings=tied)


def _layout(folder, layout):
    """The model of ``folder`` laid out as ``layout`` names it, and the forward's context."""
    from contextlib import ExitStack

    from dtensor.parallel import (from_pretrained, fully_shard, llama_tp_plan, loss_parallel,
                                  parallelize_module, replicate)
    world = dtensor.distributed.get_world_size()
    if layout == "one":
        return Llama.from_pretrained(folder), ExitStack
    if layout in ("tp", "dp2xtp2_sp", "dp2xtp2_fsdp"):
        shape = (world,) if layout == "tp" else (2, 2)
        mesh = dtensor.init_device_mesh("cpu", shape, mesh_dim_names=(
            ("tp",) if layout == "tp" else ("dp", "tp")))
        return from_pretrained(Llama, folder, mesh, sequence_parallel=layout.endswith("sp"),
                               fsdp=layout.endswith("fsdp")), ExitStack
    # the torchtitan way: a tp plan on mesh["tp"], then data parallelism on mesh["dp"]
    mesh = dtensor.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Llama.from_pretrained(folder)
    parallelize_module(model, mesh["tp"], llama_tp_plan(model))
    if layout == "dp2xtp2_fully_shard":
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        replicate(model, mesh=mesh["dp"])

    def context():
        stack = ExitStack()
        stack.enter_context(dtensor.implicit_replication())  # rotary angles are plain arrays
        stack.enter_context(loss_parallel())
        return stack
    return model, context


def _curve(folder, cfg, layout, steps=8):
    model, context = _layout(folder, layout)
    opt = dtensor.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    batches, losses = _batches(cfg), []
    for t in range(steps):
        idx, tgt = batches[t % len(batches)]
        with context():
            _, loss = model(idx, tgt)
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
        opt.step()
    return losses, {k: _whole(v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("layout", ["tp", "dp2xtp2_sp", "dp2xtp2_fully_shard"])
@pytest.mark.ranks(4, timeout=400)
def test_a_tied_head_stays_tied_in_every_layout(layout, comm, tmp_path):
    # the vocab-parallel embedding and the column-parallel lm_head both shard the one weight by
    # rows: one DTensor, whose gradient sums the lookup's and the head's
    folder, cfg = _shared_checkpoint(tmp_path, "gqa", comm, tied=True)
    model, _ = _layout(folder, layout)
    assert model.lm_head.weight is model.embed_tokens.weight
    _same_run(folder, cfg, layout)


def _same_run(folder, cfg, layout):
    want, want_params = _curve(folder, cfg, "one")
    got, params = _curve(folder, cfg, layout)
    # float32 sums in another order, 8 AdamW steps: the 1e-5 relative on the losses
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=layout)
    for k in want_params:
        # AdamW's per-step parameter change is bounded by lr, whatever the gradient's rounding
        np.testing.assert_allclose(params[k], want_params[k], rtol=0, atol=8 * 3e-3 * 1e-2,
                                   err_msg=f"{layout} {k}")


@pytest.mark.parametrize("kind", sorted(HF))
@pytest.mark.ranks(2, timeout=300)
def test_tp2_equals_one_process(kind, comm, tmp_path):
    folder, cfg = _shared_checkpoint(tmp_path, kind, comm)
    _same_run(folder, cfg, "tp")


@pytest.mark.parametrize("layout", ["tp", "dp2xtp2_sp", "dp2xtp2_fsdp", "dp2xtp2_fully_shard",
                                    "dp2xtp2_replicate"])
@pytest.mark.ranks(4, timeout=400)
def test_four_rank_layouts_equal_one_process(layout, comm, tmp_path):
    # gqa: 2 kv heads, so tp 4 replicates each over the 2 ranks that share it
    folder, cfg = _shared_checkpoint(tmp_path, "gqa", comm)
    _same_run(folder, cfg, layout)




def _tp_traffic(comm, tmp_path, kind):
    """Collectives of one forward + backward of the Llama tensor-parallel over every rank, and
    Megatron-LM's all-reduces for it (count, bytes): the embedding forward, 2 per layer forward
    and 2 backward, lm_head's input gradient, and 3 token-sized ones in the vocab-parallel
    loss."""
    from dtensor.comm import count_collectives
    folder, cfg = _shared_checkpoint(tmp_path, kind, comm)
    model = dtensor.parallel.from_pretrained(Llama, folder, dtensor.init_device_mesh(
        "cpu", (comm.size,)))
    idx, tgt = _batches(cfg)[0]
    with count_collectives() as log:
        _, loss = model(idx, tgt)
        loss.backward()
    L, tokens = cfg["num_hidden_layers"], idx.size
    act = tokens * cfg["hidden_size"] * 4
    return log.summary(), cfg, (4 * L + 2 + 3, (4 * L + 2) * act + 3 * tokens * 4)


@pytest.mark.parametrize("kind", sorted(HF))
@pytest.mark.ranks(2, timeout=300)
def test_tp2_traffic_is_megatrons(kind, comm, tmp_path):
    got, _, (count, nbytes) = _tp_traffic(comm, tmp_path, kind)
    assert got == {"all_reduce": (count, nbytes)}


@pytest.mark.ranks(4, timeout=300)
def test_tp4_over_two_kv_heads_adds_only_the_kv_weight_gradients(comm, tmp_path):
    # each rank computes both kv heads (replicated k/v projections) and reads its own: nothing
    # activation-sized moves; each k/v weight's gradient arrives Partial and is all-reduced once
    got, cfg, (count, nbytes) = _tp_traffic(comm, tmp_path, "gqa")
    L = cfg["num_hidden_layers"]
    kv_weight = cfg["num_key_value_heads"] * cfg["head_dim"] * cfg["hidden_size"] * 4
    assert got == {"all_reduce": (count + 2 * L, nbytes + 2 * L * kv_weight)}
