"""Neural-network modules with PyTorch's names: ``dtensor.nn.Linear``, ``dtensor.nn.GPT`` ..."""
from dtensor.nn import functional, init, utils
from dtensor.nn.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from dtensor.nn.layers import (GELU, CrossEntropyLoss, Dropout, Embedding, Identity, LayerNorm,
                               Linear, ReLU, RMSNorm, RotaryEmbedding, SiLU)
from dtensor.nn.llama import Llama, LlamaConfig
from dtensor.nn.module import Module, ModuleDict, ModuleList, Parameter, Sequential

__all__ = ["functional", "init", "utils", "Module", "ModuleList", "ModuleDict", "Sequential",
           "Parameter", "Linear", "Embedding", "LayerNorm", "RMSNorm", "Dropout", "GELU", "ReLU",
           "SiLU", "Identity", "CrossEntropyLoss", "RotaryEmbedding", "CausalSelfAttention",
           "MLP", "Block", "GPT", "GPTConfig", "Llama", "LlamaConfig"]
