"""Where a run's metrics go besides WORKDIR/metrics.jsonl, with no TensorFlow: absl's log, TensorBoard's event files,
Weights & Biases."""

import os
import pathlib
import secrets
import shutil
import sys
import tempfile
import time
import types

import numpy as np
from absl import logging
from etils import epath

from laurel import config_lib
from laurel.cli import files

WANDB_RUN_ID = 'wandb_run_id'  # in the workdir: the W&B run a resumed run continues


def check_extras(config) -> None:
  """Before anything compiles: a one-line InputError where the config's writers need an extra not installed."""
  if config.wandb.project:
    config_lib.optional_import('wandb', 'wandb', f'wandb.project={config.wandb.project!r}')


class TensorBoardWriter:
  """Event files in `logdir` by tensorboard's own writer, scalars and hparams as TensorFlow writes them. Behind '://'
  (gs://), where nothing can be appended to, each event file is written locally and uploaded whole after each event."""

  def __init__(self, logdir):
    # tensorboard then uses its own file layer even where TensorFlow is installed (which it would import: seconds).
    sys.modules.setdefault('tensorboard.compat.notf', types.ModuleType('tensorboard.compat.notf'))
    from tensorboard.summary.writer import event_file_writer  # pylint: disable=import-outside-toplevel
    self.logdir, self.remote = epath.Path(logdir), files.is_remote(logdir)
    self.logdir.mkdir(parents=True, exist_ok=True)
    self._local = tempfile.mkdtemp(prefix='laurel_tensorboard_') if self.remote else os.fspath(logdir)
    self._events = event_file_writer.EventFileWriter(self._local)

  def _add(self, step: int, summary):
    from tensorboard.compat.proto import event_pb2  # pylint: disable=import-outside-toplevel
    self._events.add_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
    if self.remote:
      self.flush()

  def write_scalars(self, step: int, scalars: dict):
    from tensorboard.compat.proto import summary_pb2  # pylint: disable=import-outside-toplevel
    from tensorboard.plugins.scalar import metadata  # pylint: disable=import-outside-toplevel
    from tensorboard.util import tensor_util  # pylint: disable=import-outside-toplevel
    summary = summary_pb2.Summary()
    for name, value in scalars.items():
      summary.value.add(tag=name, tensor=tensor_util.make_tensor_proto(np.float32(value)),
                        metadata=metadata.create_summary_metadata(display_name=name, description=''))
    self._add(step, summary)

  def write_hparams(self, hparams: dict):
    from tensorboard.plugins.hparams import summary_v2  # pylint: disable=import-outside-toplevel
    self._add(0, summary_v2.hparams_pb(hparams))

  def flush(self):
    self._events.flush()
    self._upload()

  def close(self):
    self._events.close()
    self._upload()
    if self.remote:
      shutil.rmtree(self._local)

  def _upload(self):
    for name in os.listdir(self._local) if self.remote else ():
      files.write_bytes_atomic(self.logdir / name, pathlib.Path(self._local, name).read_bytes())


class WandbWriter:
  """A Weights & Biases run: the flat config, scalars by step, the final figures as its summary."""

  def __init__(self, cfg, workdir: epath.Path, flat_config: dict):
    wandb = config_lib.optional_import('wandb', 'wandb', f'wandb.project={cfg.project!r}')
    id_path = workdir / WANDB_RUN_ID
    run_id = id_path.read_text().strip() if id_path.exists() else secrets.token_hex(4)  # a W&B id
    local_dir = None if files.is_remote(workdir) else os.fspath(workdir)  # W&B keeps its files on a local disk
    self._run = wandb.init(project=cfg.project, entity=cfg.entity or None, name=cfg.name or None, id=run_id,
                           resume='allow', config=flat_config, dir=local_dir)
    if not id_path.exists():
      files.write_text_atomic(id_path, run_id + '\n')

  def write_scalars(self, step: int, scalars: dict):
    self._run.log(dict(scalars), step=int(step))

  def write_summary(self, summary: dict):
    self._run.summary.update({k: v for k, v in summary.items() if isinstance(v, (bool, int, float, str))})

  def close(self):
    self._run.finish()


class MetricWriters:
  """absl's log and a run's writers as one: each call goes to each writer that has the method."""

  def __init__(self, writers):
    self.writers = list(writers)

  def _each(self, method: str, *args):
    for writer in self.writers:
      if hasattr(writer, method):
        getattr(writer, method)(*args)

  def write_scalars(self, step: int, scalars: dict):
    scalars = {k: float(v) for k, v in scalars.items() if v is not None}
    logging.info('[%d] %s', step, ', '.join(f'{k}={v:.6g}' for k, v in sorted(scalars.items())))
    self._each('write_scalars', step, scalars)

  def write_summary(self, summary: dict):
    self._each('write_summary', summary)

  def flush(self):
    self._each('flush')

  def close(self):
    self._each('close')


def create(workdir: epath.Path, config, flat_config: dict, active: bool, resumed: bool) -> MetricWriters:
  """The log; on the writing process (`active`) TensorBoard (hparams at a run's start) and W&B where configured."""
  writers = []
  if active and config.tensorboard:
    writers.append(TensorBoardWriter(workdir / 'tensorboard'))
    if not resumed:
      writers[-1].write_hparams({k: v for k, v in flat_config.items() if isinstance(v, (bool, int, float, str))})
  if active and config.wandb.project:
    writers.append(WandbWriter(config.wandb, workdir, flat_config))
  return MetricWriters(writers)
