"""The optimizer, auxiliary-loss-free balancing and the jitted training step.

The routers' correction biases take no part in the optimizer: after each step each MoE layer
(the MTP layer's included) moves its bias by γ·sign(mean load − load_e), so under-loaded
experts become likelier picks and over-loaded ones less likely (γ = 0.01 for the shipped
model; γ = 0.002 let the load CV climb to 1.2 with 24% of the slots dropped by step 30).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from glmjax.model.config import Config
from glmjax.model.weights import MoE, Weights
from glmjax.train.objective import loss_fn


def moe_modules(w: Weights) -> list:
  """The MoE modules whose bias the balancer moves, in the order the forward pass routes them
  (main layers, then the MTP layer)."""
  return [lw.mlp for lw in w.layers if isinstance(lw.mlp, MoE)] + [m.layer.mlp for m in w.mtp]


def update_bias(w: Weights, loads, gamma: float) -> Weights:
  """Aux-loss-free balancing: bias_e += γ·sign(mean load − load_e) for each MoE layer, with
  `loads` one `[E]` row per `moe_modules` entry."""
  w = jax.tree_util.tree_map(lambda x: x, w)  # fresh containers; the caller's tree is untouched
  for m, load in zip(moe_modules(w), loads):
    m.bias = m.bias + gamma * jnp.sign(jnp.mean(load) - load)
  return w


def param_labels(w: Weights):
  """'freeze' for the correction biases (never trained by gradient), 'train' elsewhere."""
  def label(path, _):
    return "freeze" if getattr(path[-1], "name", None) == "bias" else "train"
  return jax.tree_util.tree_map_with_path(label, w)


def make_optimizer(w: Weights, lr_schedule, weight_decay: float):
  """AdamW (β = 0.9, 0.95; global-norm clip 1; weight decay on matrices only), the correction
  biases frozen."""
  def decay_mask(params):
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)

  train = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(lr_schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                  mask=decay_mask))
  return optax.multi_transform({"train": train, "freeze": optax.set_to_zero()}, param_labels(w))


def make_step(cfg: Config, opt, select: bool, capacity: float, mtp_weight: float,
              index_weight: float, gamma: float):
  """The jitted training step (w, opt_state, tokens `[B, S+2]`) → (w, opt_state, metrics):
  gradients of `loss_fn`, the optimizer's update, then the balancer's."""
  def step(w, opt_state, tokens):
    grads, (metrics, loads) = jax.grad(loss_fn, has_aux=True)(
        w, tokens, cfg, select, capacity, mtp_weight, index_weight)
    updates, opt_state = opt.update(grads, opt_state, w)
    w = optax.apply_updates(w, updates)
    w = update_bias(w, loads, gamma)
    metrics["load_cv"] = jnp.mean(jnp.std(loads, axis=-1) / jnp.mean(loads, axis=-1))
    metrics["load_max"] = jnp.max(loads) * cfg.n_routed_experts
    return w, opt_state, metrics
  return jax.jit(step, donate_argnums=(0, 1))
