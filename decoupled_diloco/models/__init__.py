"""Gemma-style dense and MoE decoders behind a functional API over plain nested param dicts."""

from decoupled_diloco.models.config import (
    FLOAT32_MAX,
    PRESETS,
    ModelConfig,
    get_model_config,
    validate_model_config,
)
from decoupled_diloco.models.naming import flatten_params, unflatten_params
from decoupled_diloco.models.transformer import (
    count_params,
    forward,
    forward_features,
    init_params,
    output_logits,
    param_logical_axes,
    param_shapes,
)

__all__ = [
    "FLOAT32_MAX",
    "PRESETS",
    "ModelConfig",
    "count_params",
    "flatten_params",
    "forward",
    "forward_features",
    "get_model_config",
    "init_params",
    "output_logits",
    "param_logical_axes",
    "param_shapes",
    "unflatten_params",
    "validate_model_config",
]
