"""The train step: its state, the optimizer, and the step compiled ahead of time (laurel.plan.cost counts its FLOPs and
bytes) for a task of laurel.train_config.validate_config."""

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from laurel import designs, sharding

NO_DECAY = ('scale', 'bias', 'value_mix')  # norms, biases, value residual's mix; each design adds its own


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any  # non-trained variables, e.g. BatchNorm statistics; {} for the LM


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
