"""A cluster run tried by hand (docs/clusters.md): a preset's one input stream on two processes, process 0 alone
printing the progress, and the sbatch script's install line."""
import subprocess
import sys
import tomllib

import pytest

from helpers import ROOT, TINY_LM, cli_env, load_config
from laurel import train_config

SPEC = 'configs/c4_ablation.py:rw_lr,preset=tiny'


@pytest.mark.parametrize('data_shards, processes, streams', [(1, 1, 1), (1, 2, 2), (16, 2, 16), (3, 2, 6), (0, 4, 32)])
def test_input_streams_are_raised_to_a_multiple_of_the_process_count(data_shards, processes, streams):
  config = load_config(SPEC, {**TINY_LM, 'data_shards': data_shards, 'batch_size': 96})
  train_cfg = train_config.validate_config(config, num_devices=processes, process_count=processes).config
  assert train_config.num_data_shards(train_cfg, processes) == streams


def test_a_tiny_preset_trains_on_two_processes_without_setting_data_shards():
  config = load_config(SPEC)
  assert config.data_shards == 1
  train_config.validate_config(config, num_devices=2, process_count=2)  # refused before: 1 stream over 2 processes


@pytest.mark.parametrize('process, printed', [(0, 'first\nprogress\nfrom C\n'), (1, 'first\n')])
def test_only_process_0_prints_progress_and_every_process_its_errors(process, printed):
  """What a library writes to the descriptor (Gloo's `[Gloo] Rank 1 is connected ...`) goes too."""
  code = ('import os, sys\nfrom laurel.cli import console\nprint("first", flush=True)\n'
          f'console.quiet_unless_first({process})\nprint("progress", flush=True)\nos.write(1, b"from C\\n")\n'
          'print("error: bad", file=sys.stderr)')
  result = subprocess.run([sys.executable, '-c', code], env=cli_env(), capture_output=True, text=True, timeout=60)
  assert result.returncode == 0 and (result.stdout, result.stderr) == (printed, 'error: bad\n'), result


def test_the_sbatch_script_installs_the_cuda_extra_it_names():
  header = (ROOT / 'scripts' / 'slurm_train.sbatch').read_text().split('#SBATCH')[0]
  extras = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['optional-dependencies']
  assert "pip install -e '.[cuda,gcs]'" in header and 'cuda12' not in header
  assert any(d.startswith('jax[cuda13]') for d in extras['cuda']) and 'CUDA 13' in header
