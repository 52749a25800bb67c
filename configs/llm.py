"""The paper's LLM-1B (§3.2.1: RW+LR, r=4) and LLM-4B (§3.2.2: RW+LR, r=64) shapes.

  --config=configs/llm.py:<1b|4b>[,laurel=none][,preset=tiny]

The paper states neither shape. These are our choices, sized to the names: LLM-1B is 18 layers at D=2048,
F=8192 (GELU) ≈ 0.97B params; LLM-4B is 40 layers (Table 6's depth) at D=3072, F=7680 with SwiGLU ≈ 4.44B
(Table 6: 4.4B). LAuReL sits once per block, so its share differs from the paper's 0.012% / 0.1%: run
`python scripts/params.py --config=configs/llm.py:1b` for ours. Data: C4 with T5's 32k vocabulary.
`laurel=none` gives the matching baseline; `preset=tiny` keeps the depth ratio at CPU size.
"""

from laurel import config_lib, data, lm, train_config

SHAPES = {  # layers, d_model, heads, d_ff, mlp, rank
    '1b': (18, 2048, 16, 8192, 'gelu', 4),
    '4b': (40, 3072, 24, 7680, 'swiglu', 64),
}


def get_config(arg=None):
  row, opts = config_lib.parse_arg(arg, SHAPES, '1b', {'preset': ('paper', ('paper', 'tiny')),
                                                       'laurel': ('rw+lr', ('rw+lr', 'none'))})
  layers, d_model, heads, d_ff, mlp, rank = SHAPES[row]
  model = lambda rank, **kw: config_lib.config_dict(  # laurel=none: design 'residual', the plain x + f(x)
      lm.LMConfig, mlp=mlp, stream=dict(design='residual' if opts['laurel'] == 'none' else 'laurel'),
      laurel=dict(variant='rw+lr', rank=rank), **kw)
  if opts['preset'] == 'paper':
    return train_config.base_config(
        task='lm', row=row, preset='paper', batch_size=512, steps=100_000, log_every=100, eval_every=5000,
        eval_steps=50, checkpoint_every=2000, optimizer=dict(learning_rate=3e-4, warmup_steps=2000),
        mesh=dict(data=1, fsdp=-1),
        model=model(vocab_size=32768, d_model=d_model, num_heads=heads, d_ff=d_ff, num_layers=layers,
                    dtype='bfloat16', remat='dots_no_batch', rank=rank),
        data=config_lib.config_dict(data.LMDataConfig, name='c4', seq_len=2048, vocab_path=data.C4_VOCAB_PATH),
    ).lock()
  return train_config.base_config(
      task='lm', row=row, preset='tiny', steps=300, data_shards=1,
      model=model(vocab_size=264, d_model=128, num_heads=4, d_ff=384 if mlp == 'gelu' else 256,
                  num_layers=max(layers // 6, 2), rank=min(rank, 8)),
      data=config_lib.config_dict(data.LMDataConfig, name='text', seq_len=256),
  ).lock()
