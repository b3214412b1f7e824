"""``loss_parallel()``: cross-entropy on logits sharded over the class dim, without gathering.

Inside the context, ``dtensor.nn.functional.cross_entropy`` on a DTensor whose class dim is
sharded computes, per token, ``logsumexp(x) - x[target]`` from the vocab shards (Megatron's
vocab-parallel cross-entropy): three all-reduces of one number per token forward (the max, the
sum of exponentials, the target's logit) and none backward, where each rank's gradient
``softmax - onehot`` stays on its own shard; nothing of the logits' size is kept in between.

Example (logits of shape (N, V) placed [Shard(1)]):
    >>> with loss_parallel():
    ...     loss = F.cross_entropy(logits, targets)
    ...     loss.backward()
"""
from __future__ import annotations

from dtensor._flag import Flag
from dtensor.dtensor import DTensor, _redistribute, distribute_tensor
from dtensor.nn import functional
from dtensor.ops import nn as nnops
from dtensor.ops import pointwise as pw
from dtensor.ops import structural as st
from dtensor.placements import Partial, Replicate, Shard

__all__ = ["loss_parallel", "loss_parallel_enabled", "vocab_parallel_nll"]


_state = Flag(False)


def loss_parallel():
    """Make cross_entropy on class-sharded DTensor logits vocab-parallel inside the block."""
    return _state.set(True)


def loss_parallel_enabled() -> bool:
    return _state.on


def _cross_entropy(logits, target, ignore_index: int):
    """cross_entropy's handler: (nll, valid) of class-sharded logits inside the context."""
    if not (_state.on and class_sharded(logits)):
        return None
    target = target_like(target, logits)
    valid = target != ignore_index
    return vocab_parallel_nll(logits, target, valid), valid


functional.HANDLERS["cross_entropy"] = _cross_entropy


def class_sharded(x) -> bool:
    """Whether ``x`` is a DTensor whose last (class) dim is sharded on some mesh dim."""
    return isinstance(x, DTensor) and any(p == Shard(x.ndim - 1) for p in x.placements)


def target_like(target, logits: DTensor):
    """Targets laid out as the logits' non-class dims (a plain target is the global one)."""
    if isinstance(target, DTensor):
        return target
    cls = logits.ndim - 1
    placements = [p if isinstance(p, Shard) and p.dim != cls else Replicate()
                  for p in logits.placements]
    return distribute_tensor(target, logits.device_mesh, placements, src_data_rank=None)


def vocab_parallel_nll(x: DTensor, target: DTensor, valid: DTensor):
    """Per-token negative log-likelihood (0 where not ``valid``) of class-sharded logits
    ``x``; the result is whole (not Partial) over the class mesh dims."""
    x = _whole(x)  # logits given as partial sums: summed once, for the forward and backward
    m = x.detach().max(-1, keepdims=True)  # all-reduce 1 (max); a constant for the gradient
    # Each rank's sum of exp(x - m) over its classes, a Partial(sum): one pass over its block,
    # and nothing of the logits' size kept for the backward, which computes exp(x - m) again
    lse = nnops.sum_exp(x, m).log()  # all-reduce 2 (sum of exponentials), before the log
    safe = pw.where(valid, target, 0)  # an ignored row still needs an in-range index
    picked = st.gather(x, safe.unsqueeze(-1), axis=x.ndim - 1).squeeze(-1) - m.squeeze(-1)
    # All-reduce 3: the target's logit lives on one rank. Reducing it here keeps the loss
    # per token whole (reduction="none" gives real values) and the backward free of
    # communication: the gradient of a redistribute from Partial passes through as it is.
    return pw.where(valid, lse - _whole(picked), 0.0)


def _whole(t: DTensor) -> DTensor:
    """``t`` with its Partial placements reduced (Replicate), its shards as they are."""
    if not any(isinstance(p, Partial) for p in t.placements):
        return t
    return _redistribute(t, [Replicate() if isinstance(p, Partial) else p
                             for p in t.placements], boundary=True)
