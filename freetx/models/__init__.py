"""Models: plain nn.Modules following the model protocol; parallelism comes from outside.

protocol.py           what freetx asks of a model; presets through one builder per family
transformer.py        the Llama-style decoder (DecoderBlock), presets tiny ... llama3_8b
moe.py                its mixture-of-experts MLP (Mixtral, Qwen3-MoE): router, grouped experts
transformer_hf.py     its HF layouts (Llama, Mistral, Qwen2, Qwen3, OLMo 2, Mixtral, Qwen3-MoE)
hf.py                 finding a model's HF layout (the checkpoint package asks here)
free_transformer.py   the Free Transformer: the decoder + a per-token latent
ad.py                 the Algorithm Distillation transformer
"""

from freetx.models.protocol import (
    LatentModel,
    Model,
    build_config,
    build_model,
    builds,
    flops_per_token,
    model_class,
    num_active_parameters,
    num_parameters,
)

__all__ = [
    "LatentModel",
    "Model",
    "build_config",
    "build_model",
    "builds",
    "flops_per_token",
    "model_class",
    "num_active_parameters",
    "num_parameters",
]
