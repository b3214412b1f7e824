"""Neural-network modules with PyTorch's names: ``dtensor.nn.Linear``, ``dtensor.nn.GPT`` ..."""
from dtensor.nn import functional, utils
from dtensor.nn.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from dtensor.nn.layers import GELU, Dropout, Embedding, LayerNorm, Linear, ReLU, RMSNorm
from dtensor.nn.module import Module, ModuleList, Parameter, Sequential

__all__ = ["functional", "utils", "Module", "ModuleList", "Sequential", "Parameter", "Linear",
           "Embedding",
           "LayerNorm", "RMSNorm", "Dropout", "GELU", "ReLU", "CausalSelfAttention", "MLP",
           "Block", "GPT", "GPTConfig"]
