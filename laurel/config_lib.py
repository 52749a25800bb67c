"""Shared pieces of the `get_config(arg)` files in configs/.

`arg` is a row name with optional `key=value` options: `rw_lr`, `rw_lr,preset=tiny`.
"""

from __future__ import annotations

import dataclasses

import ml_collections
import numpy as np

# Logical axis -> mesh axes. Parameters shard over fsdp (and tensor for the wide dims); activations shard
# their batch over data x fsdp. Override in a config to try other layouts.
LOGICAL_AXIS_RULES = (
    ('act_batch', ('data', 'fsdp')),
    ('act_len', None),
    ('act_embed', None),
    ('act_heads', 'tensor'),
    ('act_mlp', 'tensor'),
    ('act_vocab', 'tensor'),
    ('act_channels', None),
    ('embed', 'fsdp'),
    ('vocab', 'tensor'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv', None),
    ('layers', None),
    ('laurel_rank', None),
    ('laurel_k', None),
    ('laurel_rw', None),
    ('laurel_sites', None),
    ('conv_in', None),
    ('conv_out', 'fsdp'),
    ('classes', None),
    ('spatial', None),
)


def known_fields(cls, cfg, field: str, skip=('laurel',)) -> dict:
  """The entries of `cfg` that are fields of dataclass `cls`; an unknown one is a one-line ValueError."""
  names = {f.name for f in dataclasses.fields(cls)}
  values = {k: v for k, v in cfg.items() if k not in skip}
  unknown = sorted(set(values) - names)
  if unknown:
    raise ValueError(f'{field}.{unknown[0]}: unknown field (known: {", ".join(sorted(names - set(skip)))})')
  return values


def is_int(value) -> bool:
  """An integer, not a bool (True is an int to Python, never a sensible rank or width)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def require(ok: bool, field: str, value, why: str) -> None:
  if not ok:
    raise ValueError(f'{field}={value!r}: {why}')


def parse_arg(arg: str | None, rows, default_row: str, options: dict) -> tuple[str, dict]:
  """'row,key=value,...' -> (row, {key: value}). `options` maps key -> (default, allowed values).

  Unknown rows, options or values raise a one-line ValueError naming them.
  """
  row, chosen = default_row, {k: default for k, (default, _) in options.items()}
  for part in (p.strip() for p in (arg or '').split(',')):
    if not part:
      continue
    if '=' not in part:
      row = part
      continue
    key, value = part.split('=', 1)
    if key not in options:
      raise ValueError(f'config arg {key}={value!r}: unknown option (known: {", ".join(sorted(options))})')
    if value not in options[key][1]:
      raise ValueError(f'config arg {key}={value!r}: must be one of {", ".join(options[key][1])}')
    chosen[key] = value
  if row not in rows:
    raise ValueError(f'config row {row!r}: unknown (known: {", ".join(rows)})')
  return row, chosen


# Byte-level tokenizer of the local text corpus: 0 = padding, byte b -> b + 1, 257 = end of document.
BYTE_VOCAB_SIZE = 258
DEFAULT_VOCAB_PATH = 'gs://t5-data/vocabs/cc_all.32000/sentencepiece.model'


def lm_model(layers, d_model, heads, d_ff, vocab, laurel) -> ml_collections.ConfigDict:
  """Every field of laurel.lm.LMConfig."""
  m = ml_collections.ConfigDict()
  m.vocab_size = vocab
  m.d_model = d_model
  m.num_heads = heads
  m.d_ff = d_ff
  m.num_layers = layers
  m.max_len = 2048
  m.norm_position = 'pre'
  m.positional = 'rope'
  m.rope_base = 10_000.0
  m.mlp = 'gelu'
  m.tie_embeddings = True
  m.dtype = 'float32'
  m.param_dtype = 'float32'
  m.scan_layers = True
  m.remat = 'none'
  m.laurel = laurel
  return m


def lm_data(name: str, seq_len: int) -> ml_collections.ConfigDict:
  """Every field of the LM input pipeline (laurel.data); `name` picks the source."""
  d = ml_collections.ConfigDict()
  d.name = name  # 'c4' | 'text' | 'synthetic'
  d.seq_len = seq_len
  d.path = ''  # text: a glob of files; '' = the running interpreter's standard library (*.py)
  d.validation_fraction = 0.05  # text: share of files held out, chosen by a hash of the path
  d.tfds_name = 'c4/en:3.1.0'
  d.tfds_data_dir = ''  # '' = TFDS's default ($TFDS_DATA_DIR or ~/tensorflow_datasets)
  d.train_split = 'train'
  d.eval_split = 'validation'
  d.vocab_path = DEFAULT_VOCAB_PATH if name == 'c4' else ''
  d.num_workers = 0  # grain worker processes; 0 reads in the main process
  d.prefetch = 2
  return d


def laurel_config(**overrides) -> ml_collections.ConfigDict:
  """Every field of laurel.residual.LaurelSpec, so each is overridable from the command line."""
  c = ml_collections.ConfigDict()
  c.variant = 'none'
  c.rank = 32
  c.k = 3
  c.rw_norm = 'softmax'
  c.rw_scale = 2.0
  c.rw_per_dim = False
  c.a_init = 'column_orthogonal'
  c.pa_h = 'identity'
  c.form = 'paper'
  c.site = 'block'
  c.update(overrides)
  return c


def trainer_config() -> ml_collections.ConfigDict:
  """Fields of the train loop shared by every task; task configs fill in model and data."""
  c = ml_collections.ConfigDict()
  c.task = 'lm'
  c.seed = 0
  c.steps = 1000
  c.batch_size = 16  # global, in sequences (LM) or images
  c.log_every = 50
  c.eval_every = 500
  c.eval_steps = 10
  c.checkpoint_every = 500
  c.keep_checkpoints = 3
  c.tensorboard = True
  c.data_shards = 0  # input shards; 0 = one per process. Fixing it makes batches independent of host count.

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 100
  c.optimizer.min_lr_ratio = 0.1  # cosine decays to learning_rate * min_lr_ratio
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.1
  c.optimizer.grad_clip = 1.0
  c.optimizer.grad_accum_steps = 1

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # -1 takes the devices the other axes leave
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.logical_axis_rules = LOGICAL_AXIS_RULES
  return c
