"""The paper's published numbers (arXiv 2411.07501), the one copy that the scripts and tests compare against."""


def _table(columns, rows):
  return {row: dict(zip(columns, values)) for row, values in rows.items()}


# Table 5 (C4, ~10B tokens, TPU v6e 4x4); the ratios are to Baseline-24, as the paper prints them.
TABLE5 = _table(('params_m', 'test_loss', 'peak_memory_gb', 'step_time_s', 'step_time_ratio', 'peak_memory_ratio'), {
    'baseline_24': (157.20, 3.0159, 11.65, 0.095, 1.000, 1.000),
    'baseline_28': (179.23, 2.9963, 13.23, 0.105, 1.105, 1.136),
    'rw': (157.20, 2.9557, 11.93, 0.095, 1.000, 1.024),
    'lr': (158.40, 2.9624, 12.29, 0.098, 1.032, 1.055),
    'pa': (157.22, 2.9512, 12.55, 0.100, 1.053, 1.077),
    'rw_lr': (158.40, 2.9531, 12.57, 0.099, 1.042, 1.079),
    'rw_lr_pa': (160.83, 2.9499, 12.90, 0.104, 1.095, 1.107),
})

# Table 1 (ResNet-50, ImageNet-1K, 16 TPU v5e chips): mean best top-1 (%) over 5 trials, params added (%).
TABLE1 = _table(('top1', 'params_added_pct'), {
    'baseline': (74.95, 0.0),
    'baseline_plus_1': (75.20, 4.37),
    'rw': (75.10, 0.003),
    'rw_lr': (75.20, 1.68),
    'rw_lr_pa': (75.25, 2.40),
})
