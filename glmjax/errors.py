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


class ExpertIOError(GlmjaxError):
  """A failed, corrupt or stalled read of a routed expert (glmjax.offload.expert_io). `layer`
  and `expert` name it, as the message does. `rows` are the batch rows whose tokens routed to
  it in the step that needed it (None: not known), so that a server fails those requests only;
  `kv` is the KV cache the failed step left behind, usable from the step's start (None: lost),
  taken by whoever resumes the other rows (glmjax.serving.batch)."""

  def __init__(self, message: str, layer: int | None = None, expert: int | None = None):
    super().__init__(message)
    self.layer, self.expert = layer, expert
    self.rows: tuple[int, ...] | None = None
    self.kv = None
