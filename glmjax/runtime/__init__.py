"""How a loaded model's steps run: the `Executor` interface and its two implementations.

Decoding, speculation, serving, calibration and the studies take an executor (and a tokenizer
where they need one), never `Model`, and never ask where the weights live:

* `executor.ResidentExecutor`: each decoder layer two jitted halves over resident weights
  (`layer_step`: identical halves share an executable); a store whose experts all fit runs
  this way, its engine kept for telemetry.
* `offloaded.OffloadExecutor`: the offload engine's layer steps (glmjax.offload), its routed
  experts in the device/host/disk tiers.

`executor.executor_for` picks one when a model is loaded; it is the only place that asks.
`clock.CompileClock` times compilation apart from the steps it interrupts.
"""
