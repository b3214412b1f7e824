"""Parallel styles and ``parallelize`` (tensor, sequence and 2-D parallelism) live here."""
