"""Graph -> Graph passes, in the order the pipeline runs them (compile/api.py)."""
from dtensor.compile.passes.collectives import bucket_all_reduces, shard_broadcasts
from dtensor.compile.passes.fusion import fuse_adamw, fuse_pointwise
from dtensor.compile.passes.matmuls import merge_matmuls
from dtensor.compile.passes.memory import plan_memory
from dtensor.compile.passes.simplify import cse, dce, fold_product_sums, fold_scatter_adds

__all__ = ["shard_broadcasts", "dce", "cse", "fold_scatter_adds", "fold_product_sums",
           "merge_matmuls", "bucket_all_reduces", "fuse_pointwise", "fuse_adamw", "plan_memory"]
