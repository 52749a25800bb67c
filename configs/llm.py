"""The paper's LLM-1B (§3.2.1: RW+LR, r=4) and LLM-4B (§3.2.2: RW+LR, r=64) shapes.

  --config=configs/llm.py:<1b|4b>[,laurel=none][,preset=tiny]

The paper states neither shape. These are our choices, sized to the names: LLM-1B is 18 layers at D=2048,
F=8192 (GELU) ≈ 0.97B params; LLM-4B is 40 layers (Table 6's depth) at D=3072, F=7680 with SwiGLU ≈ 4.44B
(Table 6: 4.4B). LAuReL sits once per block, so its share differs from the paper's 0.012% / 0.1%: run
`python -m laurel.params --config=configs/llm.py:1b` for ours. Data: C4 with T5's 32k vocabulary.
`laurel=none` gives the matching baseline; `preset=tiny` keeps the depth ratio at CPU size.
"""

from laurel import config_lib

SHAPES = {  # layers, d_model, heads, d_ff, mlp, rank
    '1b': (18, 2048, 16, 8192, 'gelu', 4),
    '4b': (40, 3072, 24, 7680, 'swiglu', 64),
}


def get_config(arg=None):
  row, opts = config_lib.parse_arg(arg, SHAPES, '1b', {'preset': ('paper', ('paper', 'tiny')),
                                                       'laurel': ('rw+lr', ('rw+lr', 'none'))})
  layers, d_model, heads, d_ff, mlp, rank = SHAPES[row]
  c = config_lib.trainer_config()
  c.row = row
  c.preset = opts['preset']
  laurel = config_lib.laurel_config(variant=opts['laurel'], rank=rank)
  if opts['preset'] == 'paper':
    c.model = config_lib.lm_model(layers, d_model, heads, d_ff, 32768, laurel)
    c.model.dtype = 'bfloat16'
    c.model.remat = 'dots_no_batch'
    c.data = config_lib.lm_data('c4', seq_len=2048)
    c.batch_size = 512
    c.steps = 100_000
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 2000
    c.mesh.fsdp = -1
    c.mesh.data = 1
    c.log_every = 100
    c.eval_every = 5000
    c.eval_steps = 50
    c.checkpoint_every = 2000
  else:
    laurel.rank = min(rank, 8)
    c.model = config_lib.lm_model(max(layers // 6, 2), 128, 4, 384 if mlp == 'gelu' else 256, 264, laurel)
    c.data = config_lib.lm_data('text', seq_len=256)
    c.steps = 300
  c.model.mlp = mlp
  c.lock()
  return c
