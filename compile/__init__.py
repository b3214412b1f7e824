"""Kernel compilation helpers (imported as ``dtensor.compile``)."""
