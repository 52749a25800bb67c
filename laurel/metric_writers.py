"""Where a run's metrics go besides WORKDIR/metrics.jsonl (laurel.train.MetricsLog), with no TensorFlow.

  LogWriter          absl's log: '[step] name=value, ...' (what every process writes)
  TensorBoardWriter  event files through tensorboard's own writer: each scalar as tf.summary.scalar writes it, and
                     the config's hparams for TensorBoard's HParams tab
  WandbWriter        Weights & Biases (the optional extra [wandb]), only where config.wandb.project is set; the run
                     id lives in WORKDIR/wandb_run_id, so a resumed run continues the same W&B run
  Progress           steps_per_sec and uptime every log_every steps
  Profiler           a jax.profiler trace of config.profile_steps in WORKDIR/profile
  create(...)        the writers of a run, as one MetricWriters; check_extras: their extras, before compiling
"""

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

from laurel import config_lib, files

WANDB_RUN_ID = 'wandb_run_id'  # in the workdir: the W&B run a resumed run continues


def check_extras(config) -> None:
  """The optional extras the config's writers need are installed (a one-line InputError otherwise), checked
  before anything compiles."""
  wandb_cfg = config.get('wandb') if hasattr(config, 'get') else getattr(config, 'wandb', None)
  if wandb_cfg is not None and wandb_cfg.project:
    config_lib.optional_import('wandb', 'wandb', f'wandb.project={wandb_cfg.project!r}')


class LogWriter:
  """Scalars as one absl INFO line per call, as clu's LoggingWriter wrote them."""

  def write_scalars(self, step: int, scalars: dict):
    logging.info('[%d] %s', step, ', '.join(f'{k}={v:.6g}' for k, v in sorted(scalars.items())))

  def write_hparams(self, hparams: dict):
    logging.info('hparams: %s', ', '.join(f'{k}={v}' for k, v in sorted(hparams.items())))

  def write_summary(self, summary: dict):
    del summary  # the closing lines of the run say it

  def flush(self):
    pass

  def close(self):
    pass


class TensorBoardWriter:
  """Event files in `logdir`, written by tensorboard's EventFileWriter: no TensorFlow. Scalars are tensor summaries
  of the scalars plugin, as tf.summary.scalar (and so clu) wrote them; hparams are the HParams plugin's
  session-start summary. Behind '://' (gs://), where objects cannot be appended to, the events go to a local
  folder and each event file is uploaded whole after every write (files.write_bytes_atomic)."""

  def __init__(self, logdir):
    # tensorboard.compat.notf makes tensorboard use its own file layer even where TensorFlow is installed, which it
    # would otherwise import (seconds) to write the same files.
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

  def write_summary(self, summary: dict):
    del summary  # TensorBoard keeps the last scalars

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
  """A Weights & Biases run: the flat config at its start, scalars by step, the final figures as its summary.
  `wandb.init` sends only what WANDB_MODE allows (offline: nothing; files under WORKDIR/wandb)."""

  def __init__(self, cfg, workdir: epath.Path, flat_config: dict):
    wandb = config_lib.optional_import('wandb', 'wandb', f'wandb.project={cfg.project!r}')
    id_path = workdir / WANDB_RUN_ID
    run_id = id_path.read_text().strip() if id_path.exists() else secrets.token_hex(4)  # a W&B id
    local = '://' not in os.fspath(workdir)  # W&B keeps its files on a local disk
    self._run = wandb.init(project=cfg.project, entity=cfg.entity or None, name=cfg.name or None, id=run_id,
                           resume='allow', config=flat_config, dir=os.fspath(workdir) if local else None)
    if not id_path.exists():
      files.write_text_atomic(id_path, run_id + '\n')

  def write_scalars(self, step: int, scalars: dict):
    self._run.log(dict(scalars), step=int(step))

  def write_hparams(self, hparams: dict):
    del hparams  # wandb.init took the config

  def write_summary(self, summary: dict):
    self._run.summary.update({k: v for k, v in summary.items() if isinstance(v, (bool, int, float, str))})

  def flush(self):
    pass

  def close(self):
    self._run.finish()


class MetricWriters:
  """Several writers as one: every call goes to each, in order."""

  def __init__(self, writers):
    self.writers = list(writers)

  def write_scalars(self, step: int, scalars: dict):
    scalars = {k: float(v) for k, v in scalars.items() if v is not None}
    for w in self.writers:
      w.write_scalars(step, scalars)

  def write_hparams(self, hparams: dict):
    for w in self.writers:
      w.write_hparams(hparams)

  def write_summary(self, summary: dict):
    for w in self.writers:
      w.write_summary(summary)

  def flush(self):
    for w in self.writers:
      w.flush()

  def close(self):
    for w in self.writers:
      w.close()


def scalar_hparams(flat_config: dict) -> dict:
  """The config's fields TensorBoard's HParams tab can show: bools, numbers and strings."""
  return {k: v for k, v in flat_config.items() if isinstance(v, (bool, int, float, str))}


def create(workdir: epath.Path, config, flat_config: dict, active: bool, resumed: bool) -> MetricWriters:
  """The run's writers: the log always; on the writing process (`active`) TensorBoard where config.tensorboard,
  W&B where config.wandb.project. Hparams go to TensorBoard once, at a run's start."""
  writers = [LogWriter()]
  if active and config.tensorboard:
    writers.append(TensorBoardWriter(workdir / 'tensorboard'))
    if not resumed:
      writers[-1].write_hparams(scalar_hparams(flat_config))
  wandb_cfg = config.get('wandb')
  if active and wandb_cfg is not None and wandb_cfg.project:
    writers.append(WandbWriter(wandb_cfg, workdir, flat_config))
  return MetricWriters(writers)


class Progress:
  """steps_per_sec (since the last report) and uptime (since this process began the loop) every `every` steps and
  at the last, as clu's ReportProgress wrote them; the first step seen only starts the clock."""

  def __init__(self, writer: MetricWriters, every: int, total: int):
    self.writer, self.every, self.total = writer, every, total
    self.t0, self.last = time.monotonic(), None

  def after_step(self, done: int):
    now = time.monotonic()
    if self.last is None:
      self.last = (done, now)
    elif done != self.last[0] and (done % self.every == 0 or done == self.total):
      self.writer.write_scalars(done, {'steps_per_sec': (done - self.last[0]) / (now - self.last[1]),
                                       'uptime': now - self.t0})
      self.last = (done, now)


class Profiler:
  """A jax.profiler trace into `logdir` (TensorBoard's profile plugin, Perfetto) of the steps numbered start + 1 to
  stop (the steps after the first `start`), as clu's Profile took them: `after_step(done)` after each step."""

  def __init__(self, logdir, profile_steps: tuple):
    self.logdir, (self.start, self.stop) = os.fspath(logdir), profile_steps or (None, None)
    self.running = False

  def after_step(self, done: int):
    import jax  # pylint: disable=import-outside-toplevel
    if done == self.start and not self.running:
      jax.profiler.start_trace(self.logdir)
      self.running = True
    elif self.running and done >= self.stop:
      self.close()

  def close(self):
    import jax  # pylint: disable=import-outside-toplevel
    if self.running:
      self.running = False
      jax.profiler.stop_trace()
