"""Compile time, apart from the steps it interrupts."""

from __future__ import annotations

import time

import jax


class CompileClock:
  """Seconds JAX spends tracing, lowering and compiling while it is open (its monitoring
  events, from any thread). Steps first met mid-run (a verify width per draft length, the
  engine's fused step) compile there; their time is reported apart from decoding.

  The events nest (a jit traced inside another's trace reports its own duration within the
  outer one), so the clock counts the union of their intervals, not the sum of their
  durations: a sum could exceed the wall time and make a prefill time negative."""

  EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")

  def __init__(self):
    self._spans: list[tuple[float, float]] = []  # (start, end), perf_counter seconds

  def _listen(self, event, duration, **_):
    if event in self.EVENTS:  # called as the event ends
      end = time.perf_counter()
      self._spans.append((end - duration, end))

  @property
  def seconds(self) -> float:
    """The length of the union of the events' intervals so far."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(self._spans):
      if end > reach:
        total += end - max(start, reach)
        reach = end
    return total

  def __enter__(self):
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)
