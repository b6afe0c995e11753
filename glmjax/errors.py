"""Error types. Every user-facing failure is one of these, with a message naming the file,
tensor, layer or expert at fault, so scripts can print it without a traceback."""


class GlmjaxError(Exception):
  """Base class for errors glmjax reports to users."""


class ConfigError(GlmjaxError):
  """A config.json that is missing keys, has the wrong model_type or absurd sizes."""


class CheckpointError(GlmjaxError):
  """A checkpoint that is missing, truncated, or has missing/unexpected/misshapen tensors."""


class InputError(GlmjaxError):
  """Bad arguments to a public call (token ids out of range, sequence too long, ...)."""


class PeerError(GlmjaxError):
  """Another process of a multi-process run died or left: a collective could not complete."""
