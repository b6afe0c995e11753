"""Replay: routing traces on disk and a cache simulator that replays them.

    from glmjax.replay import Trace, simulate
    trace = Trace.open("/tmp/trace")
    simulate(trace, "lru", per_layer=16)["hit_rate"]
"""

from glmjax.replay.policies import POLICIES, Policy, register
from glmjax.replay import engine_model  # noqa: F401  (registers "lfru")
from glmjax.replay.simulate import simulate
from glmjax.replay.trace import Trace, TraceWriter

__all__ = ["Trace", "TraceWriter", "simulate", "POLICIES", "Policy", "register"]
