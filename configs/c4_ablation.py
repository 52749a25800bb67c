"""Table 5 of the paper: LAuReL variants on a small decoder-only LM pre-trained on C4.

  --config=configs/c4_ablation.py:<row>[,preset=tiny|small|gpu]

Rows: baseline_24, baseline_28, rw, lr (r=32), pa (k=3), rw_lr, rw_lr_pa. LAuReL rows sit on Baseline-24.

preset=paper: the paper does not state the model shape. D=768, F=2048, 12 heads, a non-gated GELU MLP,
RMSNorm and tied embeddings fit Table 5's counts: 4 extra layers add 4·(4D² + 2DF + 2D) = 22.03M, and a
vocabulary of 32,768 (T5's 32k SentencePiece model, padded to 2^15 so the vocab axis shards evenly) gives
157.32M / 179.35M for Baseline-24/28 (Table 5: 157.20M / 179.23M). Batch 512 × 1024 tokens for 19,073 steps
is 10.0B tokens, the paper's "~10B" (its batch and length are not given). PA uses identity h (eq. 4), which
is what Table 5's +0.02M fits; RW+LR+PA is eq. 6 with one rank-32 pair per previous activation. Attention is
laurel.flash's kernel on TPU (model.attention=auto; the xla reference elsewhere), q, k and v saved per layer
(model.remat=save_qkv).

preset=tiny: the same rows shrunk to train on 2 CPU cores: 6/7 layers, D=128, F=384 (the paper's F/D),
4 heads, r=8 (r/D = 6%, the paper's is 4%), byte-level tokens from the embedded local text corpus
(the Python standard library), 500 steps of 16 × 128 tokens (1.0M tokens).

preset=gpu: the rows sized for one GPU, on a corpus every machine has: byte tokens of every Python source
installed on it (the standard library and each site-packages on sys.path, data.path='<installed>'; 5% of the files
held out by a hash of their path). 6/7 layers (as tiny, 28/24 layers apart), D=512, F=1536, 8 heads, r=16, bf16
compute, cuDNN attention where the GPU serves it (model.attention=auto), 500 steps of 128 x 512 bytes = 32.8M
tokens: 2.1 tokens per parameter for Baseline-24 (15.87M params), 1.8 for Baseline-28 (18.49M). laurel's model
FLOPs (6N per token plus 12·layers·D·L attention, no causal saving) are 7.48, 8.71 and 7.59 TFLOP a step for
Baseline-24, Baseline-28 and RW+LR+PA. The size was chosen for three seeds of those rows in 6 minutes at an
assumed 25% MFU. Measured on one H200 (results/README.md): a run alone took 85-95 s at 5% MFU, so the nine take
about 14 minutes; and three seeds did not resolve Baseline-28 (paired differences' sd 0.018 nats, against the
paper's gap of 0.012 at this loss). The eval set
(32 batches, 2.1M held-out tokens) is 64 times tiny's; its standard error over batches was 0.032 nats, and being the
same for every run it cancels in the paired differences.

preset=small: the same rows at a size for your own corpus on one GPU (or, slowly, a CPU): 12/14 layers, D=384,
F=1024, 6 heads, r=16 (r/D = 4%, the paper's), SentencePiece tokens from laurel.prepare.text's shards
(data.name=corpus; data.path, data.vocab_path and model.vocab_size are the corpus's: its closing lines print
them), 5,000 steps of 32 × 512 tokens (82M tokens).
"""

from laurel import config_lib, data, lm, train_config

ROWS = {
    # row: (layers at paper preset, LAuReL's fields (design 'laurel'); none: design 'residual', the plain x + f(x))
    'baseline_24': (24, {}),
    'baseline_28': (28, {}),
    'rw': (24, dict(variant='rw')),
    'lr': (24, dict(variant='lr')),
    'pa': (24, dict(variant='pa', pa_h='identity')),
    'rw_lr': (24, dict(variant='rw+lr')),
    'rw_lr_pa': (24, dict(variant='rw+lr+pa')),
}
GPU_STEPS = 500  # preset=gpu: 500 steps of 128 x 512 bytes


def get_config(arg=None):
  row, opts = config_lib.parse_arg(arg, ROWS, 'rw_lr', {'preset': ('paper', ('paper', 'tiny', 'small', 'gpu'))})
  layers, laurel = ROWS[row]
  return table5_config(row, opts['preset'], layers, stream=dict(design='laurel' if laurel else 'residual'),
                       laurel=laurel)


def table5_config(row: str, preset: str, layers: int, **model):
  """Table 5's run at `preset` with `layers` at the paper preset (half of them at small, a quarter at tiny) and
  the model fields `model` (nested sections are dicts: stream=dict(design='laurel'), laurel=dict(variant='rw');
  the LAuReL rank and k are the preset's)."""
  laurel = dict(rank={'paper': 32, 'small': 16, 'gpu': 16, 'tiny': 8}[preset], k=3, **model.pop('laurel', {}))
  if preset == 'paper':
    return train_config.base_config(
        task='lm', row=row, preset='paper', baseline_row='baseline_24', batch_size=512, steps=19_073,
        log_every=100, eval_every=2000, eval_steps=50, checkpoint_every=2000,
        optimizer=dict(learning_rate=1e-3, warmup_steps=1000),
        model=config_lib.config_dict(lm.LMConfig, vocab_size=32768, d_model=768, num_heads=12, d_ff=2048,
                                     num_layers=layers, dtype='bfloat16', remat='save_qkv', attention='auto',
                                     laurel=laurel, **model),
        data=config_lib.config_dict(data.LMDataConfig, name='c4', seq_len=1024, vocab_path=data.C4_VOCAB_PATH),
    ).lock()
  if preset == 'small':  # data.path, data.vocab_path and model.vocab_size: laurel.prepare.text prints them
    return train_config.base_config(
        task='lm', row=row, preset='small', baseline_row='baseline_24', batch_size=32, steps=5000, log_every=50,
        eval_every=1000, eval_steps=20, checkpoint_every=1000,
        optimizer=dict(learning_rate=2e-3, warmup_steps=250),
        model=config_lib.config_dict(lm.LMConfig, vocab_size=32768, d_model=384, num_heads=6, d_ff=1024,
                                     num_layers=layers // 2, laurel=laurel, **model),
        data=config_lib.config_dict(data.LMDataConfig, name='corpus', seq_len=512),
    ).lock()
  if preset == 'gpu':  # the module docstring says why this size
    return train_config.base_config(
        task='lm', row=row, preset='gpu', baseline_row='baseline_24', batch_size=128, steps=GPU_STEPS, log_every=50,
        eval_every=GPU_STEPS, eval_steps=32, checkpoint_every=GPU_STEPS, data_shards=1,
        optimizer=dict(learning_rate=2e-3, warmup_steps=50),
        model=config_lib.config_dict(lm.LMConfig, vocab_size=264, d_model=512, num_heads=8, d_ff=1536,
                                     num_layers=layers // 4, dtype='bfloat16', attention='auto', max_segments=16,
                                     laurel=laurel, **model),
        data=config_lib.config_dict(data.LMDataConfig, name='text', path=data.INSTALLED, seq_len=512, prefetch=8),
    ).lock()
  # Byte vocabulary (258) padded to 264 so the vocab axis divides over tensor-parallel sizes up to 8. One input
  # stream (data_shards=1), as one CPU process reads it.
  return train_config.base_config(
      task='lm', row=row, preset='tiny', baseline_row='baseline_24', batch_size=16, steps=500, log_every=25,
      eval_every=250, eval_steps=16, checkpoint_every=250, data_shards=1,
      optimizer=dict(learning_rate=3e-3, warmup_steps=50),
      model=config_lib.config_dict(lm.LMConfig, vocab_size=264, d_model=128, num_heads=4, d_ff=384,
                                   num_layers=layers // 4, laurel=laurel, **model),
      data=config_lib.config_dict(data.LMDataConfig, name='text', seq_len=128),
  ).lock()
