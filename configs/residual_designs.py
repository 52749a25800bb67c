"""Residual-stream designs side by side, at Table 5's shape and on its data (configs/c4_ablation.py).

  --config=configs/residual_designs.py:<row>[,preset=tiny]

Every row is Baseline-24 (Table 5's model, schedule and data) with one design changed, so rows compare on
equal terms; `python scripts/params.py` gives each row's parameter count beside baseline_24's. The designs and
their papers are in laurel/designs/ (LAuReL, and Gemma 3n's LAuReL on the attention sublayer only; ReZero,
LayerScale; Hyper-Connections, mHC (and DeepSeek-V4's read-out), mHC-lite, Frac-Connections; DenseFormer;
Attention Residuals, Full and Block; MUDDFormer; DCA) and laurel/lm.py (value residual, ResidualTransformer's shared
weights).

ResidualTransformer shares every attention and MLP matrix within groups of K = 3 consecutive layers, each layer
adding a rank-R product and a diagonal (R = 16 at D = 768 as the paper's best trade-off, R = 4 at the tiny
D = 128); 24 layers (6 at tiny) divide into groups of 3. Block AttnRes counts its blocks in sites (attention and
MLP each one): 6 sites per block at the paper preset (8 blocks, the paper's recommendation), 2 at tiny (6 blocks).
8-DCA keeps the last k = 8 layers as their own columns (DCA's Table 6 form); at tiny k = 2, since 8 of 6 layers
would keep them all (the full `dca` row).
Multi-head AttnRes takes 4 channel groups: its paper (arXiv 2607.27230) was not read, so 4 is this table's choice.
"""

import pathlib
import sys

from laurel import config_lib

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # configs/ itself: this table is built on Table 5's
import c4_ablation  # pylint: disable=g-import-not-at-top,wrong-import-position


def _design(name, **fields):
  """Model overrides choosing design `name`, with `fields` of its section `model.<name>`."""
  return dict(stream=dict(design=name), **({name: fields} if fields else {}))


ROWS = {
    # row: (layers at paper preset, model overrides); sharing's rank R is filled in per preset
    'baseline_24': (24, {}),
    'baseline_28': (28, {}),
    'laurel_rw_lr': (24, _design('laurel', variant='rw+lr')),
    'laurel_rw_lr_pa': (24, _design('laurel', variant='rw+lr+pa')),
    'rezero': (24, _design('rezero')),
    'layerscale': (24, _design('layerscale')),
    'hc': (24, _design('hc')),
    'hc_dynamic': (24, _design('hc', hc_dynamic=True)),
    'mhc': (24, _design('mhc')),  # the mHC paper's form (2512.24880): streams summed at the end
    'mhc_v4_readout': (24, _design('mhc', mhc_readout='v4')),  # DeepSeek-V4's weighted read-out
    'mhc_lite': (24, _design('mhc_lite')),  # n = 4: 24 permutation matrices
    'frac': (24, _design('frac')),  # m = 2 fractions
    'frac_dynamic': (24, _design('frac', hc_dynamic=True)),
    'denseformer': (24, _design('denseformer')),
    'attnres': (24, _design('attnres')),
    'attnres_block': (24, _design('attnres_block')),
    'attnres_delta': (24, _design('attnres', attnres_delta=True)),
    'attnres_block_delta': (24, _design('attnres_block', attnres_delta=True)),
    'attnres_heads': (24, _design('attnres', attnres_heads=4)),
    'mudd': (24, _design('mudd')),  # MUDDFormer: Q, K, V, R streams, the paper's base form
    'mudd_r': (24, _design('mudd', mudd_streams='r')),  # the R stream alone
    'dca': (24, _design('dca')),  # DeepCrossAttention: GRN sums as q, k, v inputs
    'dca_8': (24, _design('dca_k')),  # 8-DCA (its Table 6): the last 8 layers apart
    'value_residual': (24, dict(value_residual=True)),
    'laurel_rw_lr_value_residual': (24, dict(_design('laurel', variant='rw+lr'), value_residual=True)),
    'gemma3n_laurel': (24, _design('laurel', variant='lr', form='gemma3n', site='attention')),
    'residual_transformer': (24, dict(share=dict(group_size=3))),
    'residual_transformer_laurel': (24, dict(_design('laurel', variant='rw+lr'), share=dict(group_size=3))),
}


def get_config(arg=None):
  row, opts = config_lib.parse_arg(arg, ROWS, 'baseline_24', {'preset': ('paper', ('paper', 'tiny'))})
  layers, model = ROWS[row]
  model = {k: dict(v) if isinstance(v, dict) else v for k, v in model.items()}
  if 'share' in model:
    model['share']['rank'] = 16 if opts['preset'] == 'paper' else 4
  design = model.get('stream', {}).get('design')
  if design == 'dca_k':  # k = 8 of 24 layers; 2 of 6 at tiny (8 would keep them all)
    model['dca_k'] = dict(dca_k=8 if opts['preset'] == 'paper' else 2)
  if design == 'attnres_block':  # the paper's ~8 blocks: 8 of 3 layers, 6 of 1 at tiny
    model['attnres_block'] = dict(model.get('attnres_block', {}), attnres_block=6 if opts['preset'] == 'paper' else 2)
  return c4_ablation.table5_config(row, opts['preset'], layers, **model)
