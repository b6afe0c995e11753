"""glmjax: a JAX inference runtime for GLM-5-class MoE models that do not fit in accelerator memory.

    import glmjax
    model = glmjax.load()                     # the embedded default model
    logits = model.score([[5, 6, 7]])         # [B, S, V] float32
    result = model.generate([5, 6, 7], max_new_tokens=16)
    result.tokens, result.stats["decode_tok_s"]
"""

from glmjax.api import GenerationResult, Model, load
from glmjax.model.config import Config
from glmjax.errors import CheckpointError, ConfigError, GlmjaxError, InputError

__all__ = ["load", "Model", "GenerationResult", "Config", "GlmjaxError", "ConfigError",
           "CheckpointError", "InputError"]
__version__ = "0.1.0"
