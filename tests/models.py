"""The model zoo used by the tests (lives in fxshard.zoo so the demo, CLI and benchmarks share
it)."""

from fxshard.zoo import *  # noqa: F401,F403
from fxshard.zoo import (  # noqa: F401
    MLP,
    ConvNet,
    Llama,
    LlamaConfig,
    MegatronMLP,
    MultiHeadAttention,
    UnevenMLP,
    attention_plan,
    example_input,
    init_weights,
    megatron_mlp_plan,
    megatron_tp_plan,
    mlp_plan,
    sequence_parallel_plan,
    vocab_parallel_plan,
)
