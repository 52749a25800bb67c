"""Table 5 of the paper: LAuReL variants on a small decoder-only LM pre-trained on C4.

  --config=configs/c4_ablation.py:<row>[,preset=tiny]

Rows: baseline_24, baseline_28, rw, lr (r=32), pa (k=3), rw_lr, rw_lr_pa. LAuReL rows sit on Baseline-24.

preset=paper: the paper does not state the model shape. D=768, F=2048, 12 heads, a non-gated GELU MLP,
RMSNorm and tied embeddings fit Table 5's counts: 4 extra layers add 4·(4D² + 2DF + 2D) = 22.03M, and a
vocabulary of 32,768 (T5's 32k SentencePiece model, padded to 2^15 so the vocab axis shards evenly) gives
157.32M / 179.35M for Baseline-24/28 (Table 5: 157.20M / 179.23M). Batch 512 × 1024 tokens for 19,073 steps
is 10.0B tokens, the paper's "~10B" (its batch and length are not given). PA uses identity h (eq. 4), which
is what Table 5's +0.02M fits; RW+LR+PA is eq. 6 with one rank-32 pair per previous activation.

preset=tiny: the same rows shrunk to train on 2 CPU cores: 6/7 layers, D=128, F=384 (the paper's F/D),
4 heads, r=8 (r/D = 6%, the paper's is 4%), byte-level tokens from the embedded local text corpus
(the Python standard library), 500 steps of 16 × 128 tokens (1.0M tokens).
"""

from laurel import config_lib

ROWS = {
    # row: (layers at paper preset, laurel overrides)
    'baseline_24': (24, dict(variant='none')),
    'baseline_28': (28, dict(variant='none')),
    'rw': (24, dict(variant='rw')),
    'lr': (24, dict(variant='lr')),
    'pa': (24, dict(variant='pa', pa_h='identity')),
    'rw_lr': (24, dict(variant='rw+lr')),
    'rw_lr_pa': (24, dict(variant='rw+lr+pa')),
}
PAPER_PARAMS_M = {'baseline_24': 157.20, 'baseline_28': 179.23, 'rw': 157.20, 'lr': 158.40, 'pa': 157.22,
                  'rw_lr': 158.40, 'rw_lr_pa': 160.83}
PAPER_TEST_LOSS = {'baseline_24': 3.0159, 'baseline_28': 2.9963, 'rw': 2.9557, 'lr': 2.9624, 'pa': 2.9512,
                   'rw_lr': 2.9531, 'rw_lr_pa': 2.9499}


def get_config(arg=None):
  row, opts = config_lib.parse_arg(arg, ROWS, 'rw_lr', {'preset': ('paper', ('paper', 'tiny'))})
  layers, laurel_overrides = ROWS[row]
  c = config_lib.trainer_config()
  c.task = 'lm'
  c.row = row
  c.baseline_row = 'baseline_24'
  c.preset = opts['preset']
  c.paper_params_m = PAPER_PARAMS_M[row]
  c.paper_test_loss = PAPER_TEST_LOSS[row]

  if opts['preset'] == 'paper':
    laurel = config_lib.laurel_config(rank=32, k=3, **laurel_overrides)
    c.model = config_lib.lm_model(layers, 768, 12, 2048, 32768, laurel)
    c.model.dtype = 'bfloat16'
    c.model.remat = 'dots_no_batch'
    c.data = config_lib.lm_data('c4', seq_len=1024)
    c.batch_size = 512
    c.steps = 19_073
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 1000
    c.log_every = 100
    c.eval_every = 2000
    c.eval_steps = 50
    c.checkpoint_every = 2000
  else:
    laurel = config_lib.laurel_config(rank=8, k=3, **laurel_overrides)
    # Byte vocabulary (258) padded to 264 so the vocab axis divides over tensor-parallel sizes up to 8.
    c.model = config_lib.lm_model(layers // 4, 128, 4, 384, 264, laurel)
    c.data = config_lib.lm_data('text', seq_len=128)
    c.batch_size = 16
    c.steps = 500
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 50
    c.log_every = 25
    c.eval_every = 250
    c.eval_steps = 16
    c.checkpoint_every = 250
  c.lock()
  return c
