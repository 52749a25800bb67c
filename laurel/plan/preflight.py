"""What is refused before anything compiles, as one-line InputErrors: paths, extras and the workdir (check_inputs);
data that is not there, with the command that prepares it (check_lm_data, check_image_data); a step too large for a
CPU host (check_fits_host)."""

import json
import os

import jax
from etils import epath

from laurel import config_lib, data, image_data
from laurel.config_lib import InputError, build, require
from laurel.cli import console
from laurel.run import metric_writers
from laurel.cli.files import is_remote
from laurel.plan.hardware import available_host_bytes, peak_memory_bytes


def check_inputs(task, workdir: epath.Path) -> None:
  """As one-line InputErrors, what would otherwise fail after compiling: remote paths, data, extras, the workdir."""
  for name, path in [('--workdir', os.fspath(workdir))] + [(f'data.{k}', getattr(task.data_cfg, k, '') or '')
                                                           for k in ('path', 'tfds_data_dir')]:  # vocab: check_data
    try:
      if is_remote(path):
        epath.Path(path).exists()
    except Exception as e:  # pylint: disable=broad-except  # whatever the filesystem raises, as one line
      raise InputError(f'{name}={path!r}: {config_lib.io_error_reason(e)}') from None
  if isinstance(task.data_cfg, data.LMDataConfig):
    check_lm_data(task.data_cfg, task.model_cfg.vocab_size)
  else:
    check_image_data(task.data_cfg)
  metric_writers.check_extras(task.config)
  probe = workdir / f'.write_test.{jax.process_index()}'
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe.write_text('')
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except
    raise InputError(f'--workdir={os.fspath(workdir)!r}: not writable: {config_lib.io_error_reason(e)}') from None


def check_lm_data(data_cfg, vocab_size: int | None = None) -> None:
  """An InputError unless the data and vocabulary can be read (gs:// included) and the vocabulary fits."""
  cfg = build(data.LMDataConfig, data_cfg, 'data')
  if cfg.name not in data.SENTENCEPIECE_SOURCES:
    return
  prepare = console.python_command() + (
      " -m laurel.prepare.c4 --input=<folder of C4's c4-*.json.gz> --output={}" if cfg.name == 'c4' else
      " -m laurel.prepare.text --input='<your *.jsonl.gz, *.json or *.txt files>' --output={}")
  if cfg.path:
    for split in (cfg.train_split, cfg.eval_split):
      shards = data.c4_shards(cfg.path, split, cfg.name)
      require(bool(shards), 'data.path', cfg.path,
              f'no {cfg.name}-{split}.*{data.C4_SHARD_SUFFIX} shards; write them with {prepare.format(cfg.path)}')
      require(data.num_records(shards) > 0, 'data.path', cfg.path,
              f'its {cfg.name}-{split} shards hold no documents: nothing to train or evaluate on')
  elif cfg.name == 'c4' and not cfg.tfds_data_dir and data.default_tfds_c4(cfg) is None:  # no C4 chosen, none found
    require(False, 'data.path', cfg.path, f'no C4 to read: prepare it with {prepare.format("DIR")} (docs/data.md) '
            'and set --config.data.path=DIR')
  else:
    check_tfds(cfg, f'convert C4 with {prepare.format("DIR")} and set --config.data.path=DIR')
  # validate() leaves a gs:// vocabulary to this check, where GCS is reachable
  data.check_vocab(cfg, vocab_size, f' (data.vocab_path={cfg.vocab_path!r})')


def check_image_data(data_cfg) -> None:
  """An InputError unless ImageNet's prepared ArrayRecord files are where the config says."""
  cfg = build(image_data.ImageDataConfig, data_cfg, 'data')
  if cfg.name == 'imagenet':
    check_tfds(cfg, f'prepare it with tfds build {cfg.tfds_name} --manual_dir=<ILSVRC2012 tars> '
                    '--file_format=array_record --data_dir=DIR')


def check_tfds(cfg, prepare: str) -> None:
  """An InputError unless `cfg`'s TFDS dataset and splits are prepared in ArrayRecord files."""
  found = data.tfds_version_dir(cfg.tfds_data_dir, cfg.tfds_name)
  require(found is not None, 'data.tfds_data_dir', cfg.tfds_data_dir, f'no prepared {cfg.tfds_name} in '
          f'{cfg.tfds_data_dir or "$TFDS_DATA_DIR or ~/tensorflow_datasets"}; {prepare}')
  info = json.loads((found / 'dataset_info.json').read_text())
  formats = {info.get('fileFormat', 'tfrecord'), *info.get('alternativeFileFormats', [])}
  require('array_record' in formats, 'data.tfds_data_dir', cfg.tfds_data_dir,
          f'{found} holds {"/".join(sorted(formats))} files, and random access needs ArrayRecord: tfds '
          f'convert_format --dataset_version_dir={found} --out_file_format=array_record')
  present = {s['name'] for s in info.get('splits', [])}
  for split in (cfg.train_split, cfg.eval_split):
    require(split in present, 'data.tfds_data_dir', cfg.tfds_data_dir,
            f'{found} has no split {split!r} (it has: {", ".join(sorted(present))})')


def check_fits_host(task, compiled=None, num_devices: int = 1) -> None:
  """On the CPU, whose kernel kills a step too large for the host with no message: an InputError where the step needs
  more than the host has. Before compiling (`compiled` None, as compiling alone can exhaust the host) an LM's one
  layer of attention scores; after, the compiled step's per-device peak on `num_devices` devices."""
  available = available_host_bytes()
  if jax.devices()[0].platform != 'cpu' or available is None:
    return
  config = task.config
  if compiled is None:
    rows = config.batch_size // (jax.process_count() * config.optimizer.grad_accum_steps)
    need, what = task.least_step_bytes(rows), 'one layer\'s attention scores alone need'
  else:
    need, what = peak_memory_bytes(compiled) * num_devices, 'the compiled step needs'
  if need > available:
    shape = f'batch_size={config.batch_size}' + (f', data.seq_len={config.data.seq_len}' if config.task == 'lm' else '')
    raise InputError(f'{shape}: {what} {need / 2**30:,.1f} GiB, more than the {available / 2**30:,.1f} GiB of '
                     'memory available on this host; use a smaller batch, sequence or model')
