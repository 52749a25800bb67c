"""The train step: the typed config (TrainConfig, built once at the edge by build_config), the optimizer, and the
step compiled ahead of time (laurel.plan.cost counts its FLOPs and bytes)."""

import dataclasses
import functools
import math
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from laurel import config_lib, designs, sharding, tasks
from laurel.config_lib import (BOOL, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, POSITIVE_INT, STRING, InputError,
                               field, in_range, is_int, one_of, require)

LOGICAL_AXIS_RULES = designs.logical_axis_rules()  # sharding's and each registered design's
NO_DECAY = ('scale', 'bias', 'value_mix')  # norms, biases, value residual's mix; each design adds its own
UNIT_INTERVAL = in_range(0, 1, closed=(True, False))
MESH_AXIS = (lambda v: is_int(v) and (v >= 1 or v == -1), 'must be a positive integer or -1')
PROFILE_STEPS = (lambda v: v == () or (isinstance(v, tuple) and len(v) == 2 and all(map(is_int, v))
                           and 1 <= v[0] < v[1]), 'must be () or (start, stop) with 1 <= start < stop')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """`config.optimizer`: AdamW with linear warmup and cosine decay, global-norm clipping."""
  learning_rate: float = field(3e-3, POSITIVE)
  warmup_steps: int = field(100, NON_NEGATIVE_INT)
  min_lr_ratio: float = field(0.1, in_range(0, 1))  # cosine decays to learning_rate * min_lr_ratio
  b1: float = field(0.9, UNIT_INTERVAL)
  b2: float = field(0.95, UNIT_INTERVAL)
  eps: float = field(1e-8, POSITIVE)
  weight_decay: float = field(0.1, NON_NEGATIVE)
  grad_clip: float = field(1.0, POSITIVE)
  grad_accum_steps: int = field(1, POSITIVE_INT, resumable=True)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """`config.mesh`: the (data, fsdp, tensor) device mesh; -1 takes the devices the other axes leave."""
  data: int = field(-1, MESH_AXIS)
  fsdp: int = field(1, MESH_AXIS)
  tensor: int = field(1, MESH_AXIS)

  def check(self, prefix):
    sizes = dataclasses.asdict(self)
    require(list(sizes.values()).count(-1) <= 1, prefix, sizes, 'at most one axis may be -1')


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """`config.wandb`: a Weights & Biases run beside TensorBoard (the extra [wandb]); '' project = none. What it
  sends follows WANDB_MODE (offline: nothing); a resumed run continues the run whose id WORKDIR/wandb_run_id holds."""
  project: str = field('', STRING)
  entity: str = field('', STRING)  # '' = W&B's default for the logged-in user
  name: str = field('', STRING)  # '' = W&B's generated name


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The top level of a config: the train loop's fields; `model` and `data` are the task's sections."""
  task: str = field('lm', one_of(*tasks.TASKS))
  row: str = ''  # the row of the config file this is (tables and scripts group runs by it)
  preset: str = ''
  baseline_row: str = ''  # the row this one is compared with
  seed: int = field(0, (is_int, 'must be an integer'))
  steps: int = field(1000, (lambda v: is_int(v) and 1 <= v < 2**31,  # TrainState.step is an int32
                             'must be a positive integer below 2**31'), resumable=True)
  batch_size: int = field(16, POSITIVE_INT)  # global, in sequences (LM) or images
  log_every: int = field(50, POSITIVE_INT, resumable=True)
  eval_every: int = field(500, POSITIVE_INT, resumable=True)
  eval_steps: int = field(10, POSITIVE_INT, resumable=True)
  checkpoint_every: int = field(500, POSITIVE_INT, resumable=True)
  keep_checkpoints: int = field(3, POSITIVE_INT, resumable=True)
  tensorboard: bool = field(True, BOOL, resumable=True)
  profile_steps: tuple = field((), PROFILE_STEPS, resumable=True)
  # Independent input streams, split over the processes in order; 0 = gcd(batch_size, 64), and raised to a multiple
  # of the process count (num_data_shards). The global batch sequence depends on this number only, never on the
  # host count, so a run whose streams divide over its processes resumes on any slice.
  data_shards: int = field(0, NON_NEGATIVE_INT)
  # A process whose loop makes no progress (a step, an eval batch, a checkpoint save) for watchdog_factor × the
  # median step time (at least watchdog_min_s), or for watchdog_s in any case, exits with WATCHDOG_EXIT; 0 = off.
  watchdog_factor: float = field(20.0, NON_NEGATIVE, resumable=True)
  watchdog_min_s: float = field(300.0, NON_NEGATIVE, resumable=True)
  watchdog_s: float = field(3600.0, NON_NEGATIVE, resumable=True)
  optimizer: OptimizerConfig = OptimizerConfig()
  mesh: MeshConfig = field(MeshConfig(), resumable=True)
  wandb: WandbConfig = field(WandbConfig(), resumable=True)
  logical_axis_rules: tuple = field(LOGICAL_AXIS_RULES, resumable=True)
  model: Any = None  # the task's typed section (LMConfig, ResNetConfig)
  data: Any = None  # the task's typed section (LMDataConfig, ImageDataConfig)


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any  # non-trained variables, e.g. BatchNorm statistics; {} for the LM


def base_config(**overrides) -> ml_collections.ConfigDict:
  """The trainer's ConfigDict, every field at its default; configs fill in `model` and `data`."""
  return config_lib.config_dict(TrainConfig, **overrides)


def num_data_shards(config, process_count: int | None = None) -> int:
  """data_shards (0 = gcd(batch_size, 64)), raised to a multiple of the process count where it is not one: a tiny
  preset's one stream is two on two processes, each reading its own."""
  shards = config.data_shards or math.gcd(config.batch_size, 64)
  return math.lcm(shards, jax.process_count() if process_count is None else process_count)


def build_config(config) -> TrainConfig:
  """The typed config of a ConfigDict (a TrainConfig as it is), each field checked: the one conversion, at the edge."""
  if isinstance(config, TrainConfig):
    return config
  train_cfg, task = config_lib.build(TrainConfig, config, '', skip=('model', 'data')), tasks.get_task(config)
  return dataclasses.replace(train_cfg, model=task.model_cfg, data=task.data_cfg,  # a design imported later too
                             logical_axis_rules=designs.logical_axis_rules(train_cfg.logical_axis_rules))


def validate_config(config, num_devices: int | None = None, process_count: int | None = None) -> tasks.Task:
  """Every check that needs no tracing, as one-line errors naming field and value; the task of the typed config."""
  task = tasks.get_task(train_cfg := build_config(config))
  task.validate()
  num_devices = jax.device_count() if num_devices is None else num_devices
  mesh_sizes = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(train_cfg.mesh, num_devices)))
  data, fsdp = mesh_sizes['data'], mesh_sizes['fsdp']
  rules = {}
  for logical, mesh_axes in train_cfg.logical_axis_rules:  # flax takes the first rule of a name
    rules.setdefault(logical, (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ()))
  for logical, (field_name, size) in task.sharded_sizes().items():  # jax shards only whole blocks
    axes = rules.get(logical, ())
    parts = math.prod(mesh_sizes[a] for a in axes)
    require(size % parts == 0, field_name, size, f"is sharded over mesh axes {'×'.join(axes)} ({parts} devices, "
            f"logical axis {logical!r}): it must divide by {parts}")
  warmup, steps = train_cfg.optimizer.warmup_steps, train_cfg.steps
  require(warmup < steps, 'optimizer.warmup_steps', warmup,
          f'{"longer than" if warmup > steps else "as long as"} the run (steps={steps}): the learning rate would '
          f'never leave its warmup; set --config.optimizer.warmup_steps={steps // 10} (a tenth of the run) or any '
          f'value below {steps}')
  batch, accum = train_cfg.batch_size, train_cfg.optimizer.grad_accum_steps
  require(batch % accum == 0, 'batch_size', batch, f'must be divisible by optimizer.grad_accum_steps={accum}')
  require((batch // accum) % (data * fsdp) == 0, 'batch_size', batch,
          f'each micro-batch ({batch // accum}) must divide over the data-parallel size data*fsdp={data * fsdp}')
  shards = num_data_shards(train_cfg, process_count)
  require(batch % shards == 0, 'batch_size', batch, f'must divide over data_shards={shards}')
  return task


def check_overrides(config: TrainConfig, spec: str, overrides: dict) -> list[str]:
  """An InputError for an override ({field: value}) of a field the typed `config` leaves unused (a sweep would train
  one model many times) unlike the config file's (`spec`); a warning for one that only repeats the file's value."""
  unused = tasks.get_task(config).unused_fields()
  overridden = {name: value for name, value in overrides.items() if name in unused}
  base = config_lib.load(spec) if overridden else None
  for name, value in overridden.items():
    if value != functools.reduce(lambda node, part: node[part], name.split('.'), base):
      raise InputError(f'{name}={value!r}: changes nothing: {unused[name]}')
  return [f'warning: {name}={value!r} changes nothing ({unused[name]})' for name, value in overridden.items()]


def make_optimizer(o, steps):
  schedule = optax.warmup_cosine_decay_schedule(0.0, o.learning_rate, o.warmup_steps,
                                                max(steps, o.warmup_steps + 1), o.learning_rate * o.min_lr_ratio)
  no_decay = NO_DECAY + designs.no_decay()
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, p: p.ndim >= 2 and path[-1].key not in no_decay, params)
  tx = optax.chain(optax.clip_by_global_norm(o.grad_clip),
                   optax.adamw(schedule, o.b1, o.b2, o.eps, weight_decay=o.weight_decay, mask=decay_mask))
  return tx, schedule


def make_train_fns(task):
  """(optimizer, init_state(rng), train_step(state, batch)) of a task of validate_config; nothing is traced yet."""
  config = task.config
  tx, schedule = make_optimizer(config.optimizer, config.steps)
  grad_fn = jax.value_and_grad(task.loss, has_aux=True)
  k = config.optimizer.grad_accum_steps

  def init_state(rng):
    variables = nn.unbox(task.init(rng, task.example_batch(1)))
    params = variables.pop('params')
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), dict(variables))

  def micro_step(params, model_state, batch):
    (_, (metrics, model_state)), grads = grad_fn(params, model_state, batch, True)
    return grads, metrics, model_state

  def train_step(state, batch):
    if k == 1:
      grads, metrics, model_state = micro_step(state.params, state.model_state, batch)
    else:  # row i*k+j goes to micro-batch j, so each device's shard feeds every micro-batch equally
      micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)

      def body(carry, mb):  # grads weighted by each micro-batch's loss weight: exactly the full batch's mean
        g, m, ms = micro_step(state.params, carry[2], mb)
        g = jax.tree.map(lambda x: x * m['loss'][1], g)
        return (jax.tree.map(jnp.add, carry[0], g), jax.tree.map(jnp.add, carry[1], m), ms), None

      zeros = jax.eval_shape(micro_step, state.params, state.model_state, jax.tree.map(lambda x: x[0], micro))
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros[:2])
      (grads, metrics, model_state), _ = jax.lax.scan(body, (*zeros, state.model_state), micro)
      grads = jax.tree.map(lambda g: g / jnp.maximum(metrics['loss'][1], 1.0), grads)
    with jax.named_scope('optimizer'):  # the TPU compiler's estimate groups by it (laurel.plan.schedule)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
    out = {name: s / jnp.maximum(w, 1.0) for name, (s, w) in metrics.items()}
    out.update(grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step))
    return TrainState(state.step + 1, params, opt_state, model_state), out

  return tx, init_state, train_step


def compile_step(task, mesh):
  """The train step compiled ahead of time, the state initialiser, the abstract state and its shardings."""
  lowered, init, abstract, state_shardings = lower_step(task, mesh)
  return lowered.compile(), init, abstract, state_shardings


def lower_step(task, mesh):
  """compile_step's train step lowered, not yet compiled."""
  config = task.config
  tx, init_state, train_step = make_train_fns(task)
  example = task.example_batch(1)
  rng = jax.eval_shape(jax.random.key, 0)  # abstract: a concrete key would be placed on the mesh's devices
  var_shardings = sharding.logical_shardings(jax.eval_shape(task.init, rng, example), mesh, config.logical_axis_rules)
  abstract = jax.eval_shape(init_state, rng)
  repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  opt_shardings = []  # tx.init makes arrays (Adam's count): traced, so nothing is placed on the mesh's devices
  jax.eval_shape(lambda: opt_shardings.append(optax.tree_utils.tree_map_params(
      tx, lambda _, s: s, abstract.opt_state, var_shardings['params'], transform_non_params=lambda _: repl)))
  opt_shardings = opt_shardings[0]
  state_shardings = TrainState(repl, var_shardings['params'], opt_shardings,
                               {k: v for k, v in var_shardings.items() if k != 'params'})
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_shardings)
  batch_sh = sharding.batch_sharding(mesh)
  abstract_batch = {k: jax.ShapeDtypeStruct((config.batch_size, *v.shape[1:]), v.dtype, sharding=batch_sh)
                    for k, v in example.items()}
  lowered = jax.jit(train_step, in_shardings=(state_shardings, batch_sh), out_shardings=(state_shardings, repl),
                    donate_argnums=0).lower(abstract, abstract_batch)
  # Initialisation runs once and its RNG code compiles slowly on CPU at full optimisation; values are the same.
  init = jax.jit(init_state, out_shardings=state_shardings, compiler_options={'xla_backend_optimization_level': 0})
  return lowered, init, abstract, state_shardings



