"""Train a character-level GPT (or Llama) on English text that every Python install carries: the
standard library's own docstrings, gathered deterministically (sorted files, parsed with ast,
never imported).

    python examples/train.py                        # one process; loss ~4.6 -> ~2.1
    dtlaunch --nproc 8 examples/train.py            # 2-D mesh: dp=4 x tp=2, the same loss curve
    dtlaunch --nproc 4 examples/train.py --tp 2 --dp 2 --sp --fsdp
    python examples/train.py --compile              # the whole step through dtensor.compile
    python examples/train.py --compile --backend c  # ... with generated C kernels
    python examples/train.py --save-every 100       # sharded checkpoints in checkpoints/train
    dtlaunch --nproc 4 examples/train.py --resume checkpoints/train   # continue, any layout
    python examples/train.py --steps 100 --n-layer 2
    python examples/train.py --model llama          # dtensor.nn.Llama; every layout above too
    dtlaunch --nproc 4 examples/train.py --model llama --n-head 8 --kv-heads 2 --sp
    python examples/train.py --model llama --save-pretrained out/llama   # a Hugging Face folder
    dtlaunch --nproc 2 examples/train.py --model llama --init-from out/llama   # start from it
    python examples/train.py --expect-val-loss 2.5  # self-check: exit 1 unless val loss < 2.5
    python examples/train.py --help

Under dtlaunch the model goes through dtensor.parallel.parallelize on a ("dp", "tp") mesh:
Megatron tensor parallelism over "tp" (optionally sequence parallel, --sp), data parallelism
over "dp" (parameters replicated, or sharded with --fsdp). Every rank draws the same global
batch; each "dp" rank computes on its rows. By default tp is 2 (when the ranks and heads allow)
and dp takes the rest.

A run that trains as asked exits 0 and prints a sample. Flags that cannot run together (--sp
without tensor-parallel ranks, --fsdp without data-parallel ones, --backend without --compile, a
layout that needs another --nproc) exit 2 at once with the command to run instead.

--init-from reads a Hugging Face Llama folder (config.json + *.safetensors) with
Llama.from_pretrained, each rank only its own slices; its config.json sizes the model, and its
vocabulary must be the corpus's characters (a folder --save-pretrained wrote for the same
--corpus-chars). The learning rate warms up linearly to --lr, then decays along a cosine to
--min-lr (dtensor.optim.lr_scheduler.LambdaLR).

Every flag maps to a field of TrainConfig; the model is dtensor.nn.GPT or dtensor.nn.Llama.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import math
import os
import shlex
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

import dtensor


# ----------------------------------------------------------------------------- flags

def flag(default, help: str, low: float | None = None, **argparse_kwargs):
    """A TrainConfig field with its --help text and, where set, the least value it takes."""
    return field(default=default, metadata={"help": help, "low": low, **argparse_kwargs})


@dataclass
class TrainConfig:
    model: str = flag("gpt", "the model: dtensor.nn.GPT or dtensor.nn.Llama (RMSNorm, rotary "
                      "positions, grouped-query attention, SwiGLU)", choices=("gpt", "llama"))
    steps: int = flag(600, "optimizer steps to train", low=1)
    batch_size: int = flag(16, "sequences per step: the global batch, split over the dp ranks",
                           low=1)
    block_size: int = flag(64, "sequence length in characters (the model's context)", low=1)
    n_layer: int = flag(4, "Transformer blocks", low=1)
    n_head: int = flag(4, "attention heads per block (tp must divide it)", low=1)
    n_embd: int = flag(128, "embedding width (n_head must divide it)", low=1)
    kv_heads: int = flag(0, "--model llama's key/value heads, each shared by n_head / kv_heads "
                         "query heads (0: n_head / 2 when n_head is even, else n_head)", low=0)
    dropout: float = flag(0.0, "dropout probability (--model gpt)", low=0)
    lr: float = flag(2e-3, "peak learning rate (AdamW)", low=0)
    min_lr: float = flag(2e-4, "learning rate at the end of the cosine decay", low=0)
    warmup: int = flag(30, "steps of linear warmup to --lr", low=0)
    weight_decay: float = flag(0.01, "AdamW weight decay", low=0)
    grad_clip: float = flag(1.0, "clip the gradients' global norm to this", low=0)
    corpus_chars: int = flag(2_000_000, "characters of stdlib docstrings to use, 5%% of them "
                             "held out for validation", low=1)
    eval_every: int = flag(100, "print the val loss every this many steps (0: only at the end)",
                           low=0)
    seed: int = flag(1337, "seed of the initialisation, dropout, data order and sample")
    sample_chars: int = flag(300, "characters to generate after training (0: no sample)", low=0)
    tp: int = flag(0, "tensor-parallel ranks (0: 2 when the ranks and --n-head allow, else 1)",
                   low=0)
    dp: int = flag(0, "data-parallel ranks (0: the ranks tp leaves)", low=0)
    sp: bool = flag(False, "sequence parallelism: norms and dropout on sequence shards over the "
                    "tp ranks (needs tp >= 2)")
    fsdp: bool = flag(False, "shard parameters and optimizer state over the dp ranks "
                      "(needs dp >= 2)")
    compile: bool = flag(False, "run the whole train step through dtensor.compile")
    backend: str = flag("numpy", "dtensor.compile's code generator (needs --compile)",
                        choices=("numpy", "c", "triton"))
    log_every: int = flag(10, "print the train loss every this many steps", low=1)
    save_every: int = flag(0, "save a sharded checkpoint every this many steps (0: never)", low=0)
    save_dir: str = flag("checkpoints/train", "where --save-every writes")
    resume: str = flag("", "a checkpoint folder to continue from, saved by any layout")
    init_from: str = flag("", "a Hugging Face Llama folder (config.json + *.safetensors) to start "
                          "from, with --model llama; its config sets the size flags left at "
                          "their defaults, and its vocabulary must be the corpus's")
    save_pretrained: str = flag("", "with --model llama, write the trained model there as a "
                                "Hugging Face folder (what --init-from reads)")
    stop_after: int = flag(0, "stop after this many steps, as if interrupted, the schedule still "
                           "that of --steps (0: run all)", low=0)
    expect_val_loss: float = flag(0.0, "self-check: exit 1 unless the final val loss is below "
                                  "this, printing both (0: no check)", low=0)


PROMPT = "Return the "  # the start of the sample printed after training


class Layout(NamedTuple):
    world: int  # ranks in this job (1: plain python)
    dp: int
    tp: int


def mesh_shape(cfg: TrainConfig, world: int) -> tuple[int, int]:
    """(dp, tp) for ``world`` ranks, filling in the flags left at 0 (RULES check the product)."""
    if cfg.tp:
        tp = cfg.tp
    elif cfg.dp:
        tp = max(1, world // cfg.dp)
    else:
        tp = 2 if world % 2 == 0 and cfg.n_head % 2 == 0 else 1
    return cfg.dp or max(1, world // tp), tp


def kv_heads(cfg: TrainConfig) -> int:
    """Llama's key/value heads: --kv-heads, or half the query heads when they halve evenly."""
    return cfg.kv_heads or (cfg.n_head // 2 if cfg.n_head % 2 == 0 else cfg.n_head)


# The size flags --init-from's config.json sets: flag -> (LlamaConfig field, what it counts).
FOLDER_SIZES = {"n_layer": ("n_layers", "layers"), "n_head": ("n_heads", "heads"),
                "n_embd": ("dim", "channels"), "kv_heads": ("n_kv_heads", "key/value heads")}


@functools.lru_cache(maxsize=None)
def folder_config(folder: str):
    """The LlamaConfig of a Hugging Face folder's config.json, or the reason there is none."""
    from dtensor.nn import LlamaConfig
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return LlamaConfig.from_hf(json.load(f))
    except (OSError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"


def with_folder_sizes(cfg: TrainConfig) -> TrainConfig:
    """The size flags left at their defaults take the values of --init-from's config.json (a
    flag given another value stays, for RULES to report)."""
    hf = (folder_config(cfg.init_from) if cfg.model == "llama" and cfg.init_from
          and os.path.isdir(cfg.init_from) else "")
    if isinstance(hf, str):
        return cfg
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    return dataclasses.replace(cfg, **{k: getattr(hf, v) for k, (v, _) in FOLDER_SIZES.items()
                                       if getattr(cfg, k) == defaults[k]})


def relaunch(cfg: TrainConfig, nproc: int, **changes) -> str:
    """The command that runs these flags, with ``changes``, on ``nproc`` ranks."""
    new, args = dataclasses.replace(cfg, **changes), []
    for f in dataclasses.fields(new):
        value = getattr(new, f.name)
        if value != f.default:
            args += ["--" + f.name.replace("_", "-")] + ([] if value is True else [str(value)])
    head = ["python"] if nproc == 1 else ["dtlaunch", "--nproc", str(nproc)]
    return shlex.join([*head, os.path.relpath(__file__), *args])


def sp_gap(tp: int, lengths) -> int | None:
    """The first sequence length that leaves a tp rank without positions under Shard(1)
    (each rank takes ceil(T / tp)), or None."""
    return next((t for t in lengths if (tp - 1) * -(-t // tp) >= t), None)


def sp_lengths(c: TrainConfig) -> range:
    """Every sequence length the model sees: training's --block-size, and sampling's contexts,
    which grow from the prompt up to --block-size."""
    return range(min(len(PROMPT), c.block_size) if c.sample_chars else c.block_size,
                 c.block_size + 1)


# Flag combinations that cannot run as asked: (broken, message with the fix), checked in this
# order after each flag's own least value, before any data or parallel setup. The layout's own
# consistency comes before the rank count, so that a suggested command runs.
RULES: list[tuple[Callable[[TrainConfig, Layout], bool], Callable[[TrainConfig, Layout], str]]] = [
    (lambda c, L: c.model != "llama" and (c.init_from or c.save_pretrained or c.kv_heads),
     lambda c, L: f"{llama_only(c)}: for dtensor.nn.Llama, and this run trains --model "
                  f"{c.model}: add --model llama"),
    (lambda c, L: c.init_from and not os.path.isdir(c.init_from),
     lambda c, L: f"--init-from {c.init_from}: no such folder; pass a Hugging Face Llama folder "
                  f"(config.json + *.safetensors), e.g. one that --save-pretrained wrote"),
    (lambda c, L: c.init_from and isinstance(folder_config(c.init_from), str),
     lambda c, L: f"--init-from {c.init_from}: no Llama config.json there "
                  f"({folder_config(c.init_from)}); pass a Hugging Face Llama folder"),
    (lambda c, L: c.init_from and folder_clash(c),
     lambda c, L: f"--init-from {c.init_from} holds a model with {folder_clash(c)}: drop the "
                  f"flag (the folder's config.json sizes the model)"),
    (lambda c, L: c.init_from and c.block_size > folder_config(c.init_from).max_seq_len,
     lambda c, L: f"--block-size {c.block_size} is longer than the context of --init-from "
                  f"{c.init_from} (max_position_embeddings "
                  f"{folder_config(c.init_from).max_seq_len}): use --block-size "
                  f"{folder_config(c.init_from).max_seq_len} or less"),
    (lambda c, L: c.model == "llama" and c.dropout,
     lambda c, L: f"--dropout {c.dropout:g}: dtensor.nn.Llama has no dropout; drop --dropout "
                  f"or use --model gpt"),
    (lambda c, L: c.dropout >= 1,
     lambda c, L: f"--dropout {c.dropout:g} drops everything: use a probability below 1"),
    (lambda c, L: not c.init_from and c.n_embd % c.n_head,
     lambda c, L: f"--n-embd {c.n_embd} does not split into --n-head {c.n_head} heads: use an "
                  f"--n-embd that is a multiple of {c.n_head}"),
    (lambda c, L: c.model == "llama" and not c.init_from and c.n_embd // c.n_head % 2,
     lambda c, L: f"--n-embd {c.n_embd} gives heads of {c.n_embd // c.n_head} channels, and "
                  f"Llama's rotary embedding turns pairs of them: use an --n-embd that is a "
                  f"multiple of {2 * c.n_head}"),
    (lambda c, L: c.model == "llama" and c.n_head % kv_heads(c),
     lambda c, L: f"{kv_text(c)} does not divide --n-head {c.n_head} (each "
                  f"key/value head serves a whole group of query heads): use one of "
                  f"{[d for d in range(1, c.n_head + 1) if c.n_head % d == 0]}"),
    (lambda c, L: c.n_head % L.tp,
     lambda c, L: f"--n-head {c.n_head} does not split over tp={L.tp} ranks (each computes "
                  f"whole heads): use --tp {max(d for d in range(1, L.tp) if c.n_head % d == 0)}"
                  f" or an --n-head that is a multiple of {L.tp}"),
    (lambda c, L: c.sp and L.tp < 2,
     lambda c, L: f"--sp splits each sequence over the tensor-parallel ranks, and this layout "
                  f"is dp={L.dp} x tp={L.tp}: run `{relaunch(c, 2 * L.dp, tp=2 if c.tp else 0)}`"),
    (lambda c, L: c.fsdp and L.dp < 2,
     lambda c, L: f"--fsdp shards parameters over the data-parallel ranks, and this layout is "
                  f"dp={L.dp} x tp={L.tp}: run `{relaunch(c, 2 * L.tp, dp=2)}`"),
    (lambda c, L: c.batch_size % L.dp,
     lambda c, L: f"--batch-size {c.batch_size} does not split over dp={L.dp} ranks (each takes "
                  f"batch / dp whole rows): use a multiple of {L.dp}, e.g. --batch-size "
                  f"{max(L.dp, c.batch_size - c.batch_size % L.dp)}"),
    (lambda c, L: c.sp and sp_gap(L.tp, sp_lengths(c)),
     lambda c, L: f"--sp over tp={L.tp} ranks leaves a rank without positions in a sequence of "
                  f"{sp_gap(L.tp, sp_lengths(c))} (training's --block-size {c.block_size}, or a "
                  f"sampling context, which grows from the {len(PROMPT)}-character prompt to "
                  f"--block-size): use another --block-size or --tp, or drop --sp"),
    (lambda c, L: L.dp * L.tp != L.world,
     lambda c, L: f"dp={L.dp} x tp={L.tp} takes {L.dp * L.tp} ranks, and this job has "
                  f"{L.world}: run `{relaunch(c, L.dp * L.tp)}`"
                  + (f", or pick --dp and --tp whose product is {L.world}" if L.world > 1 else "")),
    (lambda c, L: c.backend != "numpy" and not c.compile,
     lambda c, L: f"--backend {c.backend} picks dtensor.compile's code generator, and this run "
                  f"is eager: add --compile"),
    (lambda c, L: c.expect_val_loss and c.stop_after and c.stop_after <= c.steps,
     lambda c, L: f"--expect-val-loss checks the final val loss, which --stop-after "
                  f"{c.stop_after} stops before: drop one of them"),
    (lambda c, L: c.resume and not os.path.isdir(c.resume),
     lambda c, L: f"--resume {c.resume}: no such folder; pass the --save-dir of a run saved "
                  f"with --save-every"),
    (lambda c, L: c.corpus_chars - int(0.95 * c.corpus_chars) <= c.block_size + 1,
     lambda c, L: f"--corpus-chars {c.corpus_chars} holds out "
                  f"{c.corpus_chars - int(0.95 * c.corpus_chars)} characters for validation, too "
                  f"few for one --block-size {c.block_size} sequence: use --corpus-chars "
                  f"{20 * (c.block_size + 2)} or more"),
]


def llama_only(c: TrainConfig) -> str:
    """The Llama-only flags this run sets, as the user wrote them."""
    return ", ".join(f"--{n.replace('_', '-')}" for n in ("init_from", "save_pretrained",
                                                        "kv_heads") if getattr(c, n))


def kv_text(c: TrainConfig) -> str:
    return (f"--kv-heads {c.kv_heads}" if c.kv_heads else
            f"--kv-heads 0 ({kv_heads(c)} key/value heads for --n-head {c.n_head})")


def folder_clash(c: TrainConfig) -> str:
    """The size flags that disagree with --init-from's config.json, e.g. "4 layers (--n-layer
    2)", or ""."""
    hf = folder_config(c.init_from)
    return ", ".join(f"{getattr(hf, v)} {what} (--{k.replace('_', '-')} {getattr(c, k)})"
                     for k, (v, what) in FOLDER_SIZES.items() if getattr(c, k) != getattr(hf, v))


def check_flags(cfg: TrainConfig, world: int) -> str | None:
    """What is wrong with these flags on ``world`` ranks and how to fix it, or None."""
    for f in dataclasses.fields(cfg):
        low, value = f.metadata["low"], getattr(cfg, f.name)
        if low is not None and value < low:
            return f"--{f.name.replace('_', '-')} {value}: must be at least {low}"
    layout = Layout(world, *mesh_shape(cfg, world))
    return next((msg(cfg, layout) for broken, msg in RULES if broken(cfg, layout)), None)


def parser() -> argparse.ArgumentParser:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    ap = argparse.ArgumentParser(
        prog=os.path.relpath(__file__), description=__doc__, formatter_class=Formatter,
        usage="python %(prog)s [flags]  or  dtlaunch --nproc N %(prog)s [flags]")
    for f in dataclasses.fields(TrainConfig):
        name, extra = "--" + f.name.replace("_", "-"), dict(f.metadata)
        extra.pop("low")  # checked by check_flags, with the other rules
        if f.type == "bool":
            ap.add_argument(name, action="store_true", **extra)
        else:
            ap.add_argument(name, type=type(f.default), default=f.default, **extra)
    return ap


def parse_args(argv: list[str] | None, world: int) -> TrainConfig:
    """TrainConfig from the command line; a flag combination that cannot run exits 2 saying
    what to change."""
    ap = parser()
    cfg = with_folder_sizes(TrainConfig(**vars(ap.parse_args(argv))))
    problem = check_flags(cfg, world)
    if problem:
        ap.error(problem)
    return cfg


# ----------------------------------------------------------------------------- data

def stdlib_docstrings(max_chars: int) -> str:
    """Module, class and function docstrings of the standard library, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo"}
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    parts.append(doc.strip() + "\n\n")
                    total += len(parts[-1])
        if total >= max_chars:
            break
    text = "".join(parts)[:max_chars]
    # Printable ASCII plus newline keeps the vocabulary small (~96 symbols).
    return "".join(c if (" " <= c <= "~" or c == "\n") else " " for c in text)


class CharData:
    def __init__(self, text: str, seed: int):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = np.array([self.stoi[c] for c in text], dtype=np.int64)
        split = int(0.95 * len(data))
        self.train, self.val = data[:split], data[split:]
        self.rng = np.random.default_rng(seed)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, split: str, batch_size: int, block_size: int):
        data = self.train if split == "train" else self.val
        starts = self.rng.integers(0, len(data) - block_size - 1, batch_size)
        x = np.stack([data[s:s + block_size] for s in starts])  # (B, T)
        y = np.stack([data[s + 1:s + block_size + 1] for s in starts])  # (B, T)
        return x, y

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


# ----------------------------------------------------------------------------- training

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * frac))


def progress(step: int, total: int, width: int = 20) -> str:
    done = int(width * step / total)
    return "[" + "#" * done + "-" * (width - done) + f"] {100 * step / total:5.1f}%"


def evaluate(model, data: CharData, cfg: TrainConfig, batches: int = 4) -> float:
    model.eval()
    with dtensor.no_grad():
        losses = [model(*data.batch("val", cfg.batch_size, cfg.block_size))[1].item()
                  for _ in range(batches)]
    model.train()
    return float(np.mean(losses))


def build_model(cfg: TrainConfig, vocab_size: int, mesh):
    """The model the flags ask for, laid out over ``mesh`` (None: one process)."""
    from dtensor.nn import GPT, GPTConfig, Llama, LlamaConfig
    from dtensor.parallel import from_pretrained, parallelize
    if cfg.init_from:  # each rank reads only its own blocks of the folder's tensors
        if mesh is None:
            return Llama.from_pretrained(cfg.init_from)
        return from_pretrained(Llama, cfg.init_from, mesh, sequence_parallel=cfg.sp,
                               fsdp=cfg.fsdp)
    if cfg.model == "llama":
        model = Llama(LlamaConfig(vocab_size=vocab_size, dim=cfg.n_embd, n_layers=cfg.n_layer,
                                  n_heads=cfg.n_head, n_kv_heads=kv_heads(cfg),
                                  max_seq_len=cfg.block_size))
    else:
        model = GPT(GPTConfig(block_size=cfg.block_size, vocab_size=vocab_size,
                              n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                              dropout=cfg.dropout))
    if mesh is not None:  # planned on a batch of the run's shape (DTENSOR_DEBUG=1 prints it)
        batch = np.zeros((cfg.batch_size, cfg.block_size), np.int64)
        parallelize(model, mesh, sequence_parallel=cfg.sp, fsdp=cfg.fsdp,
                    example_inputs=(batch, batch))
    return model


def main(argv: list[str] | None = None) -> float:
    """Train as the flags say; returns the final val loss (nan after --stop-after)."""
    world = dtensor.distributed.get_world_size()  # 1 in a plain process; MPI's under dtlaunch
    cfg = parse_args(argv, world)
    dp, tp = mesh_shape(cfg, world)
    print_ = print if dtensor.distributed.get_rank() == 0 else (lambda *a, **k: None)
    dtensor.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    data = CharData(stdlib_docstrings(cfg.corpus_chars), cfg.seed)
    print_(f"corpus: {len(data.train) + len(data.val):,} chars of Python stdlib docstrings, "
          f"vocab {data.vocab_size} ({time.perf_counter() - t0:.1f}s)")

    if cfg.init_from and folder_config(cfg.init_from).vocab_size != data.vocab_size:
        # Known only once the corpus is read; every rank reads the same corpus and exits here.
        parser().error(f"--init-from {cfg.init_from} holds a vocabulary of "
                       f"{folder_config(cfg.init_from).vocab_size} tokens, and the corpus's "
                       f"(--corpus-chars {cfg.corpus_chars}) has {data.vocab_size} characters: "
                       f"start from a folder that --save-pretrained wrote for this corpus")
    mesh = None
    if world > 1:
        mesh = dtensor.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = build_model(cfg, data.vocab_size, mesh)
    if mesh is not None:
        print_(f"mesh: dp={dp} x tp={tp}{' sequence-parallel' if cfg.sp else ''}"
               f"{' fsdp' if cfg.fsdp else ''}")
    print_(f"model: {type(model).__name__}, {model.num_params(non_embedding=False):,} "
           f"parameters; " + (f"from {cfg.init_from}" if cfg.init_from else
                              f"initial loss should be near ln({data.vocab_size}) = "
                              f"{math.log(data.vocab_size):.2f}"))
    # LambdaLR scales the base lr 1.0 by lr_at(step): the schedule's lrs are lr_at's to the bit
    # (a base of --lr times lr_at / --lr would round some of them differently).
    opt = dtensor.optim.AdamW(model.parameters(), lr=1.0, weight_decay=cfg.weight_decay)
    sched = dtensor.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, cfg))

    def train_step(x, y):
        _, loss = model(x, y)
        loss.backward()
        dtensor.optim.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        return loss

    step_fn = dtensor.compile(train_step, backend=cfg.backend) if cfg.compile else train_step

    def state() -> dict:
        """Everything a resumed run needs to continue exactly: weights, optimizer, the
        counter-based RNG and the data order's RNG, the step."""
        return {"model": model.state_dict(), "optim": opt.state_dict(),
                "sched": sched.state_dict(), "rng": dtensor.random.get_rng_state(),
                "data_rng": data.rng.bit_generator.state, "step": 0}

    start = 0
    if cfg.resume:
        st = state()
        dtensor.checkpoint.load(st, cfg.resume)
        opt.load_state_dict(st["optim"])
        sched.load_state_dict(st["sched"])
        dtensor.random.set_rng_state(st["rng"])
        data.rng.bit_generator.state = st["data_rng"]
        start = st["step"]
        print_(f"resumed from {cfg.resume} at step {start}")

    tokens = cfg.batch_size * cfg.block_size
    t_last, last_logged, loss_val = time.perf_counter(), start - 1, float("nan")
    for step in range(start, cfg.steps):
        lr = sched.get_last_lr()[0]
        loss_val = step_fn(*data.batch("train", cfg.batch_size, cfg.block_size)).item()
        if not math.isfinite(loss_val):
            # Every rank holds the same (replicated) loss, so all of them stop here together.
            raise SystemExit(
                f"step {step}: loss is {loss_val}; training diverged, stopping. The learning "
                f"rate (--lr {cfg.lr:g}, {lr:.2e} at this step) is likely too "
                f"high: lower it, lengthen --warmup, or check --grad-clip and the data.")
        sched.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            now = time.perf_counter()
            n = step - last_logged  # steps since the last line (eval and saves included)
            print_(f"step {step:5d} {progress(step + 1, cfg.steps)}  loss {loss_val:.4f}  "
                  f"lr {lr:.2e}  {n * tokens / (now - t_last):8.0f} tok/s",
                  flush=True)
            t_last, last_logged = now, step
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            val = evaluate(model, data, cfg)
            print_(f"step {step:5d} val loss {val:.4f}", flush=True)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            st = state()
            st["step"] = step + 1
            dtensor.checkpoint.save(st, cfg.save_dir)
            print_(f"step {step:5d} saved {cfg.save_dir}", flush=True)
        if cfg.stop_after and step + 1 >= cfg.stop_after:
            print_(f"stopping after step {step} (--stop-after)")
            return float("nan")

    val = evaluate(model, data, cfg)
    # A compiled step traces twice (before and after AdamW's state exists); the schedule's
    # lrs are runtime values of those two graphs, never a reason to trace again.
    print_(f"final: train loss {loss_val:.4f}, val loss {val:.4f}, "
           f"{time.perf_counter() - t0:.0f}s total"
           + (f", {step_fn.compiles} compiled graphs" if cfg.compile else ""))
    if cfg.save_pretrained:
        model.save_pretrained(cfg.save_pretrained)  # collective: every rank gives its blocks
        print_(f"saved {cfg.save_pretrained} (--init-from reads it)", flush=True)
    if cfg.sample_chars:
        # One copy of the prompt per "dp" rank (the batch is split over "dp"); print the first.
        prompt = np.array([[data.stoi[c] for c in PROMPT]] * dp)
        model.eval()
        out = model.generate(prompt, cfg.sample_chars, temperature=0.8, top_k=20)
        print_("sample:\n" + data.decode(out[0].tolist()), flush=True)
    if cfg.expect_val_loss:
        # The val loss is replicated, so every rank passes or fails together.
        passed = val < cfg.expect_val_loss
        print_(f"check: final val loss {val:.4f} {'<' if passed else '>='} --expect-val-loss "
               f"{cfg.expect_val_loss:g}: {'passed' if passed else 'FAILED'}", flush=True)
        if not passed:
            raise SystemExit(1)
    return val


if __name__ == "__main__":
    main()
