"""The offload engine: the one forward pass (glmjax.model.forward.forward) driven step by step, its
routed experts resolved against three tiers (device pool → host LRU → store on disk).

The engine composes parts with one owner each and drives the steps:
  - `Tiers` (glmjax.offload.tiers): the pin pools, the host LRU and its slabs, heat, lookups,
    installs and evictions, by the shared rules of glmjax.offload.rules;
  - `Prefetcher` (glmjax.offload.prefetch): pilot and co-activation hints, landing into free
    room only, the held-prefetch expiry, the host fill;
  - `TieredProvider` (glmjax.offload.provider): the layer steps' expert provider (lookups,
    reads, grouped compute, end-of-step bookkeeping) and `Placement` (where host-held experts
    are computed);
  - `FusedStep` (glmjax.offload.fused): the one-jit step over held experts, whose deferred
    bookkeeping runs the same tier rules as the layer steps.
The engine owns the I/O threads and the files (`save`, `close`).

Determinism: a (token, rank) term is computed by one kernel whose per-row arithmetic does not
depend on the other rows it runs with (pallas_kernels.cpu; on a CPU-only machine every tier,
resident pools included, uses it), and the combine has a fixed order, so results are bitwise
identical whatever tier served an expert and in whatever order reads complete.

With every expert resident the provider is one jitted kernel call per layer and the steps run
back to back with no host round trip.

On a mesh each device of the `expert` axis pins only experts it owns (`MeshPins`) and computes
them under shard_map; everything else its process owns runs on that process's host as above.
Across processes (`owners.Ownership`) each process's tiers, reads, prefetch and counters concern
only the experts its devices own, and one psum over `expert` per layer step combines every
owner's terms. Host cache, I/O threads and bookkeeping are the process's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from glmjax.errors import ExpertIOError, InputError
from glmjax.formats.store import ExpertStore
from glmjax.model.config import Config, Runtime
from glmjax.model.forward import (JITTED, Chunk, Drive, KVCache, Routing, forward, layers,
                                  mtp_forward)
from glmjax.model.moe import resolve_kernel
from glmjax.model.records import RecordOptions, next_moe, recording
from glmjax.model.weights import MoE, Weights
from glmjax.offload.expert_io import DEMAND, ExpertReader, drop_page_cache
from glmjax.offload.fused import FUSED_GUESS_TOKENS, FusedStep
from glmjax.offload.owners import Ownership, peer_guarded
from glmjax.offload.pinning import pin_device_tier
from glmjax.offload.prefetch import Prefetcher
from glmjax.offload.provider import Placement, TieredProvider
from glmjax.offload.rules import HostCache, layer_quotas
from glmjax.offload.shared import EngineShared
from glmjax.offload.tiers import Heat, HostSlabs, Tiers
from glmjax.options import Options
from glmjax.sharding import axis_size

USAGE_FILE = "usage.json"
PLACEMENTS = ("auto", "device", "host")
READ_LOG = 1 << 16  # reads the engine's read log keeps (~5 MB)
PREFAULT_READS = 32  # read buffers mapped at load: the 8-layer cold prefill held 27-34 at once


def _check_same_everywhere(path: str, dev_slots: int, cache_route: bool) -> None:
  """Across processes the pin pools form one array and every process runs the same steps, so
  the device budget's slots must agree; cache-aware routing would route by each process's own
  tiers, so it is refused (one collective at load)."""
  from jax.experimental import multihost_utils
  if cache_route:
    raise InputError(f"{path}: cache_route routes toward this process's resident experts; "
                     "with several processes each would route differently. Turn it off")
  got = multihost_utils.process_allgather(np.asarray([dev_slots], np.int64)).reshape(-1)
  if len(set(got.tolist())) > 1:
    raise InputError(
        f"{path}: device_cache_gb gives {got.tolist()} pinned experts per device and layer on "
        "processes 0.." f"{len(got) - 1}; every process needs the same device budget "
        "(host_cache_gb may differ)")


def folded(method):
  """An engine entry point that starts by folding a deferred fused step's record into the tiers
  and counters (`FusedStep.fold_deferred`): whoever calls it, and whatever it reads, sees every
  step run so far. Every public method of the engine, and each property that exposes tier
  state, is one (tests/test_architecture.py); nothing else folds or asks to."""
  @functools.wraps(method)
  def entry(self, *args, **kw):
    self.fused_step.fold_deferred()
    return method(self, *args, **kw)
  return entry


@dataclasses.dataclass
class Budgets:
  device_bytes: int
  host_bytes: int
  # Chunk read buffers kept for reuse (glmjax.formats.read_buffers): a part of the transients
  # the memory plan counts already (the working set's host half and the prefetched reads).
  read_buffer_bytes: int = 0


class OffloadEngine:
  """Runs the model layer by layer over dense weights and a store's routed experts."""

  def __init__(self, cfg: Config, dense: Weights, store: ExpertStore, budgets: Budgets,
               options: Options = Options(), mesh=None):
    """`options`: the load options (glmjax.options), validated there; the engine reads its
    I/O, prefetch, placement, routing and attention fields."""
    o = options
    if o.expert_compute not in PLACEMENTS:
      raise ValueError(f"expert_compute must be one of {PLACEMENTS}, got {o.expert_compute!r}")
    self.cfg, self.dense, self.store = cfg, dense, store
    self.progress = o.progress  # bars while loading, and over a layer-major prefill
    # The attention's impl: "sparse" (DSA) or the "dense" reference (the provider runs experts).
    self.runtime = Runtime(impl=o.attention)
    self.budgets = budgets
    self.expert_budget = o.expert_budget  # verify passes' expert cap (opt-in, lossy) or None
    cache_route = (o.route_keep, o.route_rank) if o.cache_route else None
    self.cache_route = cache_route
    self.moe_layers = [i for i, l in enumerate(dense.layers) if isinstance(l.mlp, MoE)]
    self.layout = store.layout(self.moe_layers[0])
    self.chunk_bytes = self.layout.nbytes
    e = cfg.n_routed_experts
    # On a mesh each device of the expert axis has the budget, for its own experts only: with
    # every expert fitting they are all resident (`pinning.sharded_layer`), otherwise each
    # device pins up to `dev_slots` of the E/n experts it owns (`MeshPins`) and the rest run on
    # the host.
    self.mesh, n_dev = mesh, axis_size(mesh, "expert")
    per_dev = budgets.device_bytes // max(1, self.chunk_bytes * len(self.moe_layers))
    dev_slots = int(min(e // n_dev, per_dev))
    self.slots = int(min(e, n_dev * per_dev))
    self.all_resident = self.slots == e
    # Ownership by process for the tiers (an all-resident mesh needs none: its pools follow the
    # plan, whatever processes an expert index spans).
    self.owners = Ownership(mesh, e) if mesh is not None and not self.all_resident else None
    if mesh is not None and jax.process_count() > 1:
      _check_same_everywhere(store.path, dev_slots, cache_route is not None)
    # The LRU rule, a share per layer: the main layers first, the MTP layer what they leave
    host_bytes = 0 if self.all_resident else budgets.host_bytes
    quotas, rest = layer_quotas(host_bytes, self.moe_layers, self.chunk_bytes, e)
    quotas.update(layer_quotas(rest, [cfg.num_hidden_layers + j for j in range(len(dense.mtp))],
                               self.chunk_bytes, e)[0])
    self.host_layers = list(quotas)
    host = HostCache(host_bytes, quotas)
    n_layers = cfg.num_hidden_layers + len(dense.mtp)
    slabs = HostSlabs(store.layout, self._max_host_slots(host), n_layers, e)
    if slabs.slab(self.moe_layers[0]).max_slots:  # the main layers' slab, filled now, not in
      slabs.slab(self.moe_layers[0]).reserve()  # the first prefill
    # The read function closes over the store only, never the engine (see ExpertReader).
    # The last READ_LOG chunks this process read, as (layer, expert), in submission order (the
    # read log): bounded, since a server reads for ever (a list grew ~1 MB a minute in a soak).
    self.read_log: collections.deque[tuple[int, int]] = collections.deque(maxlen=READ_LOG)
    read = lambda layer, expert, store=store, log=self.read_log: (
        log.append((layer, expert)), store.read_chunk(layer, expert))[1]
    self.reader = ExpertReader(read, o.io_workers, o.io_timeout_s)
    if not self.all_resident:  # a resident model reads only while it loads
      store.buffers.keep_bytes = budgets.read_buffer_bytes
      # Mapped now, not page by page inside the first prefill's reads (DESIGN.md §26).
      store.prefault_reads(PREFAULT_READS)
    # A model dropped without close() still stops its I/O threads when collected.
    self._finalizer = weakref.finalize(self, self.reader.close)
    self.usage_path = os.path.join(store.path, USAGE_FILE)
    if o.cold:
      drop_page_cache(os.path.join(store.path, "experts"))
    self._stats = collections.Counter({"experts_on_device": 0, "experts_on_host": 0,
                                       "h2d_bytes": 0})
    # pin_tables `[L, E]`: rows are the DevicePools' tables (each expert's slot, or -1)
    self._tiers = Tiers({}, host, slabs, np.full((n_layers, e), -1, np.int32),
                        Heat.load(self.usage_path), self.chunk_bytes, self._stats)
    if self.owners is not None:
      self._tiers.owned = self.owners.owned
    shared = EngineShared(cfg, dense, store, self._tiers, self.reader, self._stats,
                          self.moe_layers, mesh)
    mtp = [cfg.num_hidden_layers] if dense.mtp else []
    pin_device_tier(shared, self.slots, dev_slots, self.all_resident, mtp, o.progress)
    # Prefetch: only worth it when a landed expert has somewhere to stay.
    on_cpu = jax.default_backend() == "cpu"
    fused_on = (on_cpu and cache_route is None and not self.all_resident and mesh is None
                and len({store.layout(l) for l in self.moe_layers}) == 1)
    # A host cache that can hold every routed expert of the main layers is filled in the
    # background (FILL priority, hottest first), so that steps end up fused and never miss.
    unpinned = len(self.moe_layers) * (e - self.slots)
    self.prefetcher = Prefetcher(
        shared, o.prefetch and not self.all_resident and (host.budget > 0 or self.slots > 0),
        o.pilot_k, o.couple_k,
        fill=fused_on and unpinned > 0 and host.budget >= unpinned * self.chunk_bytes)
    self.placement = Placement(o.expert_compute, on_cpu, store, self._stats)
    self.provider = TieredProvider(shared, self.prefetcher, self.placement,
                                   resolve_kernel(o.moe_kernel), self.owners)
    # The fused step needs every expert in CPU memory addressable by slot and exact routing
    # (`fused_on`); on a mesh it is off (its pin pools are one-device): steps run layer by layer.
    self.fused_step = FusedStep(shared, self.prefetcher, self.placement, self.runtime,
                                enabled=fused_on, unit=o.compile_unit)

  def _max_host_slots(self, host: HostCache):
    """Slots a host slab of a layout may hold: the shares of the layers in that layout, each at
    most every expert of its layer (a slab sized to the whole budget per layout held the
    budget twice over once the MTP layer's int8 experts were cached beside the main ones)."""
    def slots(layout) -> int:
      return sum(min(self.cfg.n_routed_experts, int(host.share(l)) // layout.nbytes)
                 for l in self.host_layers if self.store.layout(l) == layout)
    return slots

  # -- the parts' state, by the names callers use ----------------------------------------------
  @property
  @folded
  def tiers(self) -> Tiers:
    return self._tiers

  @property
  @folded
  def stats(self) -> collections.Counter:
    """The counters, shared by the parts (what `telemetry` reports)."""
    return self._stats

  @property
  @folded
  def heat(self) -> Heat:
    return self._tiers.heat

  @property
  @folded
  def host(self) -> HostCache:
    return self._tiers.host

  @property
  @folded
  def device(self) -> dict:
    return self._tiers.device

  @property
  def prefetch(self) -> bool:
    return self.prefetcher.enabled

  @property
  def kernel(self) -> str:
    return self.provider.kernel  # the device kernel (pinned and uploaded experts)

  @property
  def stage_s(self) -> dict | None:
    """Stage timing (a dict of seconds by stage, or None); see TieredProvider."""
    return self.provider.stage_s

  @stage_s.setter
  def stage_s(self, value: dict | None) -> None:
    self.provider.stage_s = value

  @folded
  def resident_weights(self) -> Weights:
    """With every expert resident: the dense weights with each MoE layer's pool as its experts,
    for the one-jit resident path (glmjax.model.forward's entry points)."""
    pools = self._tiers.device

    def fill(i, lw):
      if not isinstance(lw.mlp, MoE):
        return lw
      return dataclasses.replace(lw, mlp=dataclasses.replace(lw.mlp, experts=pools[i].pool))
    layers = [fill(i, lw) for i, lw in enumerate(self.dense.layers)]
    mtp = [dataclasses.replace(m, layer=fill(self.cfg.num_hidden_layers + j, m.layer))
           for j, m in enumerate(self.dense.mtp)]
    return dataclasses.replace(self.dense, layers=layers, mtp=mtp)

  @folded
  def save(self) -> None:
    """Persists the usage histogram (next run's pinned set) and the co-activation table."""
    self._tiers.heat.save(self.usage_path)
    self.prefetcher.save()

  @folded
  def close(self) -> None:
    """Saves, then stops and joins the I/O threads. Idempotent; the engine is unusable after."""
    if self.closed:
      return
    self.save()
    self._finalizer()  # runs reader.close() once
    self._tiers.device.clear()
    self._tiers.host = HostCache(0)
    self._tiers.slabs = HostSlabs(self.store.layout, lambda layout: 0, 0, 0)
    self.prefetcher.inflight.clear()
    self.store.buffers.clear()

  @property
  def closed(self) -> bool:
    return not self._finalizer.alive

  @folded
  def hint(self, layer: int, experts, kind: int) -> None:
    """Queues non-resident `experts` of `layer` for reading at priority `kind`."""
    self.prefetcher.hint(layer, experts, kind)

  @folded
  def warm_host(self) -> None:
    """Reads, now, every main-layer expert that no tier holds into the host cache, as far as
    its budget allows (`Prefetcher.warm_host`)."""
    self.prefetcher.warm_host()

  # -- forward --------------------------------------------------------------------------------
  @property
  def _aware(self) -> bool:
    """Cache-aware routing is on (it needs a partly resident expert set)."""
    return self.cache_route is not None and not self.all_resident

  def _experts(self, record, record_opts):
    """The layer steps' expert provider, recording each MoE layer's routing into `record`."""
    experts = self.provider.resident_terms if self.all_resident else self.provider.tiered
    if record is not None:
      experts = recording(experts, functools.partial(next_moe, self.dense), self.cfg, record,
                            record_opts, jitted=True)
    return experts

  def _routing(self, layer: int) -> Routing | None:
    """Cache-aware routing of `layer` toward its resident experts (None: a dense layer)."""
    if layer not in self._tiers.device and layer not in self.moe_layers:
      return None
    mask = [self.prefetcher.resident(layer, e) for e in range(self.cfg.n_routed_experts)]
    keep, rank = self.cache_route
    return Routing(resident=jnp.asarray(mask), keep=keep, rank=rank)

  def _start_step(self) -> bool:
    """A forward's start (`Prefetcher.start_step`): whether every expert is held."""
    all_cached = self._tiers.all_cached(self.moe_layers)
    self.prefetcher.start_step(all_cached)
    return all_cached

  @peer_guarded
  @folded
  def forward(self, tokens, cache: KVCache | None = None, absorbed: bool | None = None,
              n_valid: int | None = None, record: list | None = None,
              record_opts: RecordOptions = RecordOptions(), expert_cap: int | None = None):
    """Logits `[B, S, V]`, final hidden `[B, S, D]` and the new cache for `tokens` `[B, S]`
    (the first `n_valid` positions real, the rest padding that never routes). With `record`
    (a list), each MoE layer's routing record (`route_record`) is appended to it. With
    `expert_cap`, each MoE layer routes the step within that many experts (lossy, opt-in)."""
    precompiling = self.prefetcher.paused
    all_cached = self._start_step()
    if not (isinstance(tokens, jax.Array) and tokens.dtype == jnp.int32):
      tokens = jnp.asarray(tokens, jnp.int32)
    out = None
    if (record is None and self.stage_s is None and expert_cap is None and not precompiling
        and self.fused_step.worth_trying(tokens.size, all_cached)):
      out, cache = self.fused_step.run(tokens, cache, absorbed, n_valid, sure=all_cached)
    if out is None:
      misses = self._stats["expert_misses"]
      routing = ((lambda _: Routing(cap=expert_cap)) if expert_cap is not None
                 else self._routing if self._aware else None)
      kept: dict = {}
      try:
        out = forward(self.dense, tokens, self.cfg, cache, absorbed, n_valid, drive=Drive(
            self._experts(record, record_opts), self._keeping(self.provider.steps(n_valid), kept),
            routing, self.runtime))
      except ExpertIOError as e:
        e.kv = self._salvaged(cache, kept)
        raise
      if not precompiling:
        self.fused_step.after_layer_steps(self._stats["expert_misses"] > misses)
    if not self.all_resident and not self.fused_step.deferred and not precompiling:
      self._tiers.heat.decay()  # else the deferred fold decays, after the uses
    return out

  @peer_guarded
  @folded
  def prefill(self, chunks: list, cache: KVCache, n_valid: int, record: list | None = None,
              record_opts: RecordOptions = RecordOptions()):
    """A prompt's chunks (token arrays `[B, S_j]`, only the last padded: its first `n_valid`
    positions real) written at the cache's length, layer-major: every chunk through layer L,
    then layer L + 1, the hidden states `[S, D]` held between layers. Each MoE layer's experts
    are looked up, read and settled once for the whole prompt, and each chunk's terms are
    combined before the next chunk's are computed. Returns (final hidden states per chunk
    `[B, S_j, D]`, the cache with the prompt written; its length is the caller's)."""
    if len(chunks) == 1:
      _, x, cache = self.forward(chunks[0], cache, n_valid=n_valid, record=record,
                                 record_opts=record_opts)
      return [x], cache
    self._start_step()
    misses = self._stats["expert_misses"]
    experts = self._experts(record, record_opts)
    start, offsets = int(cache.length), np.cumsum([0] + [c.shape[1] for c in chunks[:-1]])
    end = start + int(offsets[-1]) + n_valid  # past the last real position
    pieces = [Chunk(JITTED.embed(self.dense, t), start + int(o),
                    n_valid if j == len(chunks) - 1 else None)
              for j, (t, o) in enumerate(zip(chunks, offsets))]
    kept: dict = {}
    steps = self._keeping(self.provider.steps(end=end), kept)
    with tqdm(total=len(self.dense.layers) * len(pieces), desc="prefill", unit="chunk",
              leave=False, disable=not self.progress) as bar:
      def counted(*args, **kw):  # the bar moves by (layer, chunk)
        bar.update()
        return step(*args, **kw)
      step = steps.attn_route
      try:
        new = layers(self.dense, pieces, self.cfg, cache, None, Drive(
            experts, dataclasses.replace(steps, attn_route=counted),
            self._routing if self._aware else None, self.runtime))
      except ExpertIOError as e:
        e.kv = self._salvaged(cache, kept)
        raise
    self.fused_step.after_layer_steps(self._stats["expert_misses"] > misses)
    if not self.all_resident:
      self._tiers.heat.decay()
    return [p.x for p in pieces], KVCache(new, cache.pages, cache.length)


  def _keeping(self, steps, kept: dict):
    """`steps` whose attention step also keeps each layer's new KV arrays in `kept` (layer →
    arrays): the step donates the old ones, so a forward failing part-way would lose them."""
    attn_route = steps.attn_route

    def call(lw, x, start, **kw):
      out = attn_route(lw, x, start, **kw)
      i = self.provider.layer_of(lw)
      if i is not None and out.cache is not None:
        kept[i] = out.cache
      return out
    return dataclasses.replace(steps, attn_route=call)

  @staticmethod
  def _salvaged(cache: KVCache | None, kept: dict) -> KVCache | None:
    """What a forward over `cache` that failed on an expert read leaves usable: each layer it
    reached as that layer's attention step returned it, the layers after as they were. Every
    row's positions before the step's are intact; the positions the step wrote are
    overwritten when it runs again, so the other rows resume exactly (DESIGN.md §23)."""
    if cache is None:
      return None
    return KVCache([kept.get(i, lc) for i, lc in enumerate(cache.layers)], cache.pages,
                   cache.length)

  @folded
  def precompile(self, tokens, cache: KVCache, absorbed: bool | None = True,
                 n_valid=None) -> KVCache:
    """Compiles the steps of a `tokens` `[B, S]` shape ahead of its first real step (a
    server's batch would otherwise stall on them): runs one step whose rows are all padding
    through the layer steps (padding routes nothing, so nothing is read), and compiles the
    fused step for it (where a step that wide is tried fused) without running it. `absorbed`
    and `n_valid` (0 as one count, as a prefill passes it; None: a zero per row, as a batch
    step) are those of the real step, whose compiled programs they select. Counters, heat and
    the fused-step state are left as they were. Returns the new cache (`cache` is donated);
    its rows hold nothing valid."""
    saved = collections.Counter(self._stats)
    # a batch step may be tried fused at any width (all its experts cached), a prefill chunk
    # only when it is narrow enough for a guess (FusedStep.worth_trying)
    fused = self.fused_step.enabled and (n_valid is None or tokens.size <= FUSED_GUESS_TOKENS)
    n_valid = np.zeros(tokens.shape[0], np.int32) if n_valid is None else n_valid
    # paused: no fill, landing, expiry or learning; forward then tries nothing fused, leaves
    # the fused step's readiness and the heat as they were
    try:
      with self.prefetcher.pause():
        _, _, cache = self.forward(tokens, cache, absorbed, n_valid=n_valid)
        if fused:
          compiled, args = self.fused_step.executable(jnp.asarray(tokens, jnp.int32), cache,
                                                      absorbed, n_valid)
          cache = compiled(*args)[2]
          # after a void fused attempt the layer steps take the fused step's cache
          _, _, cache = self.forward(tokens, cache, absorbed, n_valid=n_valid)
    finally:
      self._stats.clear()  # in place: the parts share this Counter
      self._stats.update(saved)
    return cache

  @peer_guarded
  @folded
  def mtp_forward(self, h, next_tokens, cache, start: int):
    """The MTP block at positions start..start+S-1 over (h `[B, S, D]`, next tokens `[B, S]`).

    Returns (logits `[B, S, V]`, block output `[B, S, D]`, the MTP layer cache). Its routed
    experts come through the same tiers as the main layers' (the store's "mtp" group).
    """
    at = KVCache(cache.layers, cache.pages, jnp.asarray(start, jnp.int32))
    return mtp_forward(self.dense, h, jnp.asarray(next_tokens, jnp.int32), self.cfg, at,
                       absorbed=h.shape[1] <= 4,
                       drive=Drive(self._experts(None, None), JITTED, runtime=self.runtime))

  @folded
  def tier_state(self) -> dict:
    """The tiers' state as plain data (a live trace's starting point for the simulator):
    budgets, each MoE layer's pinned experts by slot, the host LRU order, raw heat."""
    t = self._tiers
    return {
        "device_bytes": self.budgets.device_bytes, "host_bytes": t.host.budget,
        "host_quotas": {str(l): q for l, q in (t.host.quotas or {}).items()},
        "host_used_bytes": t.host.used, "owned_experts": int(t.owned.sum()),
        "chunk_bytes": self.chunk_bytes, "slots": self.slots, "all_resident": self.all_resident,
        "pins": {str(l): list(d.expert_in) for l, d in t.device.items()},
        "host": [list(k) for k in t.host.keys()],
        "heat": {f"{l}/{e}": v for (l, e), v in t.heat.h.items()},
        "heat_scale": t.heat.scale}

  @folded
  def telemetry(self) -> dict[str, float]:
    """Flat numeric counters since construction (callers take differences)."""
    out = {k: float(v) for k, v in self._stats.items()}
    out["all_resident"] = float(self.all_resident)  # fast path: no per-expert accounting
    if self.prefetch:
      out["prefetch_unused"] = float(len(self.prefetcher.ledger.landed))
      out["prefetch_inflight"] = float(sum(1 for f, k in self.prefetcher.inflight.values()
                                           if k != DEMAND))
    out["io_service_s"] = self.reader.service_s
    out["io_wait_s"] = self.reader.wait_s
    return out
