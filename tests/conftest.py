import os
import sys

# tests/numpy_gpt.py (the independent reference model) is imported by name.
sys.path.insert(0, os.path.dirname(__file__))
