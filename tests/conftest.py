import os
import sys

# tests/numpy_gpt.py (the independent reference model) is imported by name.
sys.path.insert(0, os.path.dirname(__file__))

# Triton runs on CPU only under its interpreter, chosen before triton is first imported
# (dtensor.compile(backend="triton") and the Philox equivalence tests use it).
os.environ.setdefault("TRITON_INTERPRET", "1")
