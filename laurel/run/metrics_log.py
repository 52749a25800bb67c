"""What a run records of itself: WORKDIR/metrics.jsonl (MetricsLog), the code it ran (code_commit), the means of a
logging interval, final.json's median step time, and the closing lines a finished run prints (summary)."""

import functools
import json
import shlex
import statistics
import subprocess
import sys
import time

import flax
import jax
import numpy as np
from etils import epath

from laurel import command_line, config_lib, designs
from laurel.cli import console
from laurel.run import metric_writers
from laurel.cli.files import is_remote, write_text_atomic


class MetricsLog:
  """WORKDIR/metrics.jsonl (one object per logged step) beside laurel.run.metric_writers. Process 0 writes it: by
  appends where local, rewritten whole behind '://' (gcsfs overwrites on 'a'; GCS replaces an object atomically)."""
  def __init__(self, workdir: epath.Path, config, resume_step: int, info: dict, flat_config: dict | None = None):
    self.active, self.info = jax.process_index() == 0, info  # info goes on the first line this process writes
    self.path, self.lines = workdir / 'metrics.jsonl', []
    if self.active and self.path.exists():
      text = self.path.read_text()
      for number, line in enumerate(text.splitlines(), 1):
        try:
          row = json.loads(line) if line else None
        except ValueError:
          row = None
        if isinstance(row, dict) and isinstance(row.get('step'), int):
          if row['step'] <= resume_step:  # not the lines logged past the checkpoint it resumes: no step twice
            self.lines.append(line + '\n')
        elif line:
          print(f'warning: {self.path}: dropped line {number}, not a JSON object with a step (cut by a kill?): '
                f'{line[:80]!r}', file=sys.stderr, flush=True)
      if ''.join(self.lines) != text:
        write_text_atomic(self.path, ''.join(self.lines))
    if flat_config is None:
      flat_config = flax.traverse_util.flatten_dict(config_lib.to_dict(config), sep='.')  # as config.json holds it
    self.writer = metric_writers.create(workdir, config, flat_config, self.active, resumed=resume_step > 0)

  def write(self, step: int, values: dict):
    values = {k: float(v) if isinstance(v, (float, np.floating, jax.Array)) else v for k, v in values.items()}
    self.writer.write_scalars(step, {k: v for k, v in values.items() if v is not None})
    if self.active:
      self.lines.append(json.dumps({'step': step, **values, **self.info, 'time': round(time.time(), 3)}) + '\n')
      if not is_remote(self.path):
        with self.path.open('a') as f:
          f.write(self.lines[-1])
      else:
        self.path.write_text(''.join(self.lines))
      self.info = {}

  def step_times(self) -> list[float]:
    """The step_time_s of every train line logged, by earlier runs too (process 0 alone reads the log)."""
    rows = (json.loads(line) for line in self.lines)
    return [row['step_time_s'] for row in rows if isinstance(row.get('step_time_s'), (int, float))]


def config_line(cfg, workdir: epath.Path) -> str:
  """A run's first line: its config.json and what it trains."""
  return (f'config: {console.shown(workdir / "config.json")} ({cfg.task}, row {cfg.row or "-"}, design '
          f'{designs.label(cfg.model.stream)}, preset {cfg.preset or "-"}, {cfg.steps} steps)')


@functools.cache
def code_commit() -> str | None:
  """The git commit ('+' if tracked files changed), else the COMMIT file scripts/launch_tpu.py ships, else None."""
  git = lambda *args: subprocess.run(['git', '-C', str(command_line.REPO), *args], capture_output=True, text=True,
                                     check=False)
  head = git('rev-parse', 'HEAD') if (command_line.REPO / '.git').exists() else None  # not an enclosing repo's
  if head is not None and head.returncode == 0:
    return head.stdout.strip() + ('+' if git('status', '--porcelain', '--untracked-files=no').stdout.strip() else '')
  commit_file = command_line.REPO / 'COMMIT'
  return commit_file.read_text().strip() if commit_file.is_file() else None


def median_step_time(step_times: list[float]) -> dict:
  """final.json's median_step_time_s over every logged interval of every run of the workdir; null, and why, where
  none was timed."""
  if step_times:
    return {'median_step_time_s': float(np.median(step_times))}
  return {'median_step_time_s': None, 'median_step_time_why': 'metrics.jsonl holds no timed step of any run'}


def interval_mean(rows: list[dict]) -> dict:
  """Each metric's mean over a logging interval's steps (the learning rate: the last step's), and `mean_of_steps`."""
  row = {k: statistics.fmean(float(r[k]) for r in rows) for k in rows[-1] if k != 'learning_rate'}
  if 'learning_rate' in rows[-1]:
    row['learning_rate'] = float(rows[-1]['learning_rate'])
  return {**row, 'mean_of_steps': len(rows)}


def summary(config, workdir: epath.Path, final: dict, seconds: float) -> str:
  """The closing lines of a run: its final losses, where its outputs are, and what to run next."""
  path = workdir / 'metrics.jsonl'
  logged = [r for r in map(json.loads, path.read_text().splitlines() if path.exists() else []) if 'loss' in r]
  evals = ', '.join(f'{k} {final[k]:.4f}' for k in sorted((k for k in final if k.startswith('eval_')),
                                                              key=lambda k: (k != 'eval_loss', k)))
  train_loss = ''
  if logged:
    last, steps = logged[-1], logged[-1].get('mean_of_steps', 1)
    train_loss = f'; train loss {last["loss"]:.4f} ' + (f'(the mean of steps {last["step"] - steps + 1}-{last["step"]})'
                                                        if steps > 1 else f'at step {last["step"]}')
  lines = [f'finished {config.row or config.task} at step {final["step"]} in {console.duration(seconds)}: '
           f'{evals}{train_loss}',
           f'  final.json    {console.shown(workdir / "final.json")}',
           f'  checkpoints   {console.shown(workdir / "checkpoints")} (the last: step {final["step"]})',
           f'  metrics       {console.shown(path)}']
  if config.tensorboard:
    tensorboard = console.script_command('tensorboard', 'tensorboard.main')  # the venv's, which the PATH may lack
    lines.append(f'  TensorBoard   {tensorboard} --logdir {console.quoted(workdir / "tensorboard")}')
  if config.task == 'lm':
    lines += ['next:'] + next_commands(config, workdir)
  return '\n'.join(lines)


def next_commands(config, workdir: epath.Path) -> list[str]:
  """What to run on a finished LM run, each working as printed: sample it, and score its own held-out documents."""
  prompt = 'def ' if config.data.name == 'text' and not config.data.path else 'The '
  new_tokens = min(64, config.data.seq_len // 2)  # prompt and new tokens within the context it trained on
  python, run = console.python_command(), console.quoted(workdir)  # the venv's python unless it is `python`
  # Sampled: greedy decoding of a small model repeats itself (`def test the the the`).
  return [f'  {python} -m laurel.serve.generate --workdir={run} --prompt={shlex.quote(prompt)} '
          f'--max_new_tokens={new_tokens} --temperature=0.8 --top_k=40',
          f'  {python} -m laurel.serve.evaluate --workdir={run} --task=held_out --max_items=10   # the first '
          '10 of its held-out documents; text:GLOB, .jsonl and TFDS tasks: docs/evaluation.md']
