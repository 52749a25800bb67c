"""What the one train loop needs from a model family: model, loss, metrics, data."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from laurel import attention, cross_entropy, data, designs, image_data, lm, resnet, sharding
from laurel.config_lib import DTYPES, InputError, build


class Task:
  """A model family as laurel.step and laurel.train use it: `config`, typed `model_cfg` and `data_cfg`, `model`, and
    validate()  one-line InputErrors: the sections' cross checks (laurel.plan.preflight: whether the data is there)
    unused_fields() -> {field: why}, sharded_sizes() -> {logical axis: (field, size)}, laurel_site_widths(),
    num_params(params), units_per_example(), model_flops(b), example_batch(b), init(rng, batch), least_step_bytes(b),
    unestimated_kernel_flops(b),
    dataset(train, batch_size, seed, process_index, process_count) -> a grain.IterDataset,
    loss(params, model_state, batch, train) -> (loss, (metrics, model_state)), each metric a (sum, weight) pair,
    design_report(params) -> {name: array}, the residual design's own diagnostics, and design_metrics(fetched report)
    -> {metric: float}, the training metrics the loop logs of it."""
  unit: str  # what a batch row is, for throughput: 'tokens' or 'images'
  classes: tuple  # (model config, data config, model)

  def __init__(self, config):
    model_config, data_config, model = self.classes
    self.config = config
    self.model_cfg = model_config.from_config(config.model)
    self.data_cfg = build(data_config, config.data, 'data')
    self.model = model(self.model_cfg)

  def validate(self):
    pass

  def num_params(self, params) -> int:
    return sharding.num_params(params)

  def units_per_example(self) -> int:
    return 1

  def least_step_bytes(self, batch_size: int) -> int:
    return 0

  def unestimated_kernel_flops(self, batch_size: int) -> float:
    """FLOPs of a train step's kernels that carry no cost estimate (laurel.plan.schedule counts them from this)."""
    return 0.0

  def design_report(self, params) -> dict:
    return {}

  def design_metrics(self, report: dict) -> dict[str, float]:
    """A fetched design_report as scalars `<design section>/<name>_<index>` (laurel.designs.scalars)."""
    return designs.scalars(designs.select(self.model_cfg)[0].section, report)


def _stack(trees: list, axis: int = 0):
  """Parameter trees of the same structure, their leaves stacked along `axis` ({} for trees without leaves)."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves, axis), *trees) if trees else {}


def _chain_output(design, spec, params: dict, name: str, *args, **kwargs):
  """What a design's chain module (its parameters in params[name], none there if it has none) gives its sites."""
  return design.chain(spec, *args, **kwargs).apply({'params': params.get(name, {})})


class LMTask(Task):
  """Next-token prediction on packed sequences; the loss skips padding and document boundaries."""
  unit = 'tokens'
  classes = (lm.LMConfig, data.LMDataConfig, lm.LM)

  def validate(self):
    cfg, seq_len = self.model_cfg, self.data_cfg.seq_len
    data.validate(self.data_cfg, cfg.vocab_size)
    if cfg.attention in attention.BLOCKED and not attention.splash_block(seq_len):
      raise InputError(f'model.attention={cfg.attention!r}: needs data.seq_len to be a multiple of 128, not {seq_len}')
    if cfg.positional == 'learned' and cfg.max_len < seq_len:  # the lookup clamps: later positions would share one
      raise InputError(f'model.max_len={cfg.max_len}: shorter than data.seq_len={seq_len}; learned positions need one '
                       'embedding per position')
    if cfg.max_segments > seq_len:
      raise InputError(f'model.max_segments={cfg.max_segments}: a row of data.seq_len={seq_len} tokens holds at most '
                       f'{seq_len} documents')
    if cfg.attention == 'cudnn' and (reason := attention.cudnn_unsupported(cfg)):
      raise InputError(reason)

  def unused_fields(self) -> dict[str, str]:
    return {**self.model_cfg.unused_fields('model'), **data.unused_fields(self.data_cfg)}

  def sharded_sizes(self) -> dict[str, tuple[str, int]]:
    m = self.model_cfg
    return {'heads': ('model.num_heads', m.num_heads), 'mlp': ('model.d_ff', m.d_ff),
            'vocab': ('model.vocab_size', m.vocab_size), 'embed': ('model.d_model', m.d_model)}

  def units_per_example(self) -> int:
    return self.data_cfg.seq_len

  def laurel_site_widths(self) -> list[int]:
    return [self.model_cfg.d_model] * self.model_cfg.num_sites

  def num_params(self, params) -> int:
    """Less a design's scan padding (stored parameters that are structurally 0)."""
    design, spec = designs.select(self.model_cfg)
    padding = design.padded_params(spec, self.model_cfg.num_layers, self.model_cfg.d_model)
    return sharding.num_params(params) - padding

  def least_step_bytes(self, batch_size: int) -> int:
    """Memory known before compiling: one layer's L×L scores, on the paths that hold them."""
    cfg, seq_len = self.model_cfg, self.data_cfg.seq_len
    if attention.attention_impl(cfg, seq_len) not in ('xla', 'dot_product'):
      return 0
    return batch_size * cfg.num_heads * seq_len**2 * jnp.dtype(DTYPES[cfg.attention_scores]).itemsize

  def unestimated_kernel_flops(self, batch_size: int) -> float:
    """jax's splash kernel has no cost estimate: its attention's FLOPs, forward and backward (laurel.flash's has)."""
    cfg, seq_len = self.model_cfg, self.data_cfg.seq_len
    if attention.attention_impl(cfg, seq_len) != 'splash':
      return 0.0
    return cfg.num_layers * attention.attention_flops(batch_size, seq_len, cfg.num_heads, cfg.d_model // cfg.num_heads)

  def model_flops(self, batch_size: int) -> float:
    """PaLM's model FLOPs (appendix B): 6N + 12·L·H·Q·T per token, N the parameters that multiply an activation (no
    lookup tables; shared weights once per layer)."""
    cfg = dataclasses.replace(self.model_cfg, share=lm.ShareSpec())
    batch = self.example_batch(1)
    shapes = jax.eval_shape(lm.LM(cfg).init, jax.random.key(0), batch['tokens'], batch['positions'])['params']
    lookup_rows = cfg.vocab_size * (not cfg.tie_embeddings) + cfg.max_len * (cfg.positional == 'learned')
    n = self.num_params(shapes) - lookup_rows * cfg.d_model  # a tied embedding counts, as the output projection
    seq_len = self.data_cfg.seq_len
    return batch_size * seq_len * (6 * n + 12 * cfg.num_layers * cfg.d_model * seq_len)

  def example_batch(self, batch_size: int) -> dict:
    shape = (batch_size, self.data_cfg.seq_len)
    return {'tokens': np.zeros(shape, np.int32), 'segment_ids': np.ones(shape, np.int32),
            'positions': np.zeros(shape, np.int32)}

  def init(self, rng, batch) -> dict:
    return self.model.init(rng, batch['tokens'], batch['positions'], batch['segment_ids'])

  def loss(self, params, model_state, batch, train: bool):
    del train  # no dropout
    tokens_BxL, segments_BxL = batch['tokens'], batch['segment_ids']
    x_BxLxD = self.model.apply({'params': params, **model_state}, tokens_BxL, batch['positions'], segments_BxL,
                               hidden=True)
    targets_BxL, weights_BxL = cross_entropy.shifted_targets(tokens_BxL, segments_BxL)
    nll, correct = cross_entropy.chunked(x_BxLxD, *lm.output_kernel(self.model_cfg, params), targets_BxL,
                                         weights_BxL, self.model_cfg.loss_chunk, DTYPES[self.model_cfg.dtype])
    n = weights_BxL.sum()
    metrics = {'loss': (nll, n), 'accuracy': (correct, n)}
    return nll / jnp.maximum(n, 1.0), (metrics, model_state)

  def dataset(self, **kwargs):
    return data.lm_dataset(self.data_cfg, max_segments=self.model_cfg.max_segments, **kwargs)

  def design_report(self, params) -> dict:
    """Design.diagnostics of the LM's chain output and its sites' parameters, stacked (layers, sites per layer), read
    from the parameters alone: cheap, outside the step (the loop jits it for its logging steps)."""
    cfg, (design, spec) = self.model_cfg, designs.select(self.model_cfg)
    if design.diagnostics is None:
      return {}
    chain = _chain_output(design, spec, params, design.chain.module_name, cfg.num_layers, cfg.sites_per_layer,
                          cfg.d_model, DTYPES[cfg.param_dtype])
    names = [name for name, _ in designs.layer_sites(design, spec) if name is not None]
    if cfg.scan_layers:  # one tree, leading axis the layer
      sites = _stack([params['layers'].get(name, {}) for name in names], axis=1)
    else:
      sites = _stack([_stack([params[f'layers_{i}'].get(name, {}) for name in names])
                      for i in range(cfg.num_layers)])
    return design.diagnostics(spec, chain, sites)


class ClassificationTask(Task):
  """Image classification with top-1/top-5 accuracy; BatchNorm statistics are the model state."""
  unit = 'images'
  classes = (resnet.ResNetConfig, image_data.ImageDataConfig, resnet.ResNet)

  def unused_fields(self) -> dict[str, str]:
    return self.model_cfg.unused_fields('model')

  def sharded_sizes(self) -> dict[str, tuple[str, int]]:
    return {'conv_out': ('model.base_width', self.model_cfg.base_width)}  # every width is a multiple of it

  def laurel_site_widths(self) -> list[int]:
    return list(self.model_cfg.block_channels)

  def model_flops(self, batch_size: int) -> float:
    """3× the compiler's FLOPs of the forward pass, as convolutions reuse weights."""
    images = jax.ShapeDtypeStruct(self.example_batch(batch_size)['images'].shape, jnp.float32)
    variables = jax.eval_shape(self.init, jax.random.key(0), self.example_batch(1))
    cost = jax.jit(lambda v, x: self.model.apply(v, x, train=False)).lower(variables, images).cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}  # none under the CUDA and TPU plug-ins
    return 3 * float(cost.get('flops', 0.0))

  def example_batch(self, batch_size: int) -> dict:
    s = self.data_cfg.image_size
    return {'images': np.zeros((batch_size, s, s, 3), np.float32), 'labels': np.zeros((batch_size,), np.int32)}

  def init(self, rng, batch) -> dict:
    return self.model.init(rng, batch['images'], train=False)

  def loss(self, params, model_state, batch, train: bool):
    logits_BxC, updates = self.model.apply({'params': params, **model_state}, batch['images'], train=train,
                                           mutable=['batch_stats'] if train else [])  # eval: updates {}
    model_state = {**model_state, **updates}
    labels_B = batch['labels']
    ce_B = optax.softmax_cross_entropy_with_integer_labels(logits_BxC, labels_B)
    top5_BxK = jax.lax.top_k(logits_BxC, min(5, logits_BxC.shape[-1]))[1]
    n = jnp.asarray(labels_B.shape[0], jnp.float32)
    metrics = {'loss': (ce_B.sum(), n),
               'top1': ((jnp.argmax(logits_BxC, -1) == labels_B).sum().astype(jnp.float32), n),
               'top5': ((top5_BxK == labels_B[:, None]).any(-1).sum().astype(jnp.float32), n)}
    return ce_B.mean(), (metrics, model_state)

  def dataset(self, **kwargs):
    return image_data.image_dataset(self.data_cfg, **kwargs)

  def design_report(self, params) -> dict:
    """Design.diagnostics of each stage's chain (one site per bottleneck), named `stage<s>_<name>`."""
    cfg, (design, spec) = self.model_cfg, designs.select(self.model_cfg)
    if design.diagnostics is None:
      return {}
    out = {}
    for s, blocks in enumerate(cfg.stage_sizes, 1):
      chain = _chain_output(design, spec, params, f'stage{s}_{design.chain.module_name}', blocks, 1,
                            resnet.EXPANSION * cfg.base_width * 2 ** (s - 1), DTYPES[cfg.param_dtype],
                            embed_axis='conv_out')
      sites = _stack([_stack([params[f'stage{s}_block{j}'].get(design.section, {})]) for j in range(blocks)])
      out.update({f'stage{s}_{name}': value for name, value in design.diagnostics(spec, chain, sites).items()})
    return out


TASKS = {'lm': LMTask, 'classification': ClassificationTask}


def get_task(config) -> Task:
  if config.task not in TASKS:
    raise InputError(f'task={config.task!r}: must be one of {", ".join(TASKS)}')
  return TASKS[config.task](config)
