"""Every command the README and docs show, and every command a finished run prints, works as printed: the cheap ones
run here (`runs/demo` being a copy of conftest.trained_run), each other one is skipped for a reason SKIPPED lists.
laurel.prepare.text's closing command is run as printed in tests/test_c4.py; laurel.prepare.c4's reads T5's
vocabulary from gs:// and real C4, and is not run."""
import ast
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from etils import epath

from as_printed import run_as_printed
from helpers import ROOT, cli_env, without_this_python
from laurel import command_line, config_lib, train_config
from laurel.run import metrics_log

DOCS = ['README.md', *sorted(str(p.relative_to(ROOT)) for p in (ROOT / 'docs').glob('*.md'))]
# A code block's line is a command when its first word (after NAME=value settings) is one of these; the README's
# sample run prints `TensorBoard   <command>`.
PROGRAMS = ('python', 'python3', '.venv/bin/python', 'laurel-train', 'laurel-generate', 'laurel-evaluate',
            'laurel-lm-eval', 'laurel-prepare-c4', 'laurel-prepare-text', 'tensorboard', '.venv/bin/tensorboard',
            'make', 'pip', 'git', 'cd', 'export', 'sbatch', 'srun', 'mpirun', 'xpk', 'kubectl', 'gcloud',
            'scripts/gpu_check.sh')
# (pattern, why it is not run here), the first that a command matches; a command that matches none is run.
SKIPPED = [
    (r'\b(sbatch|srun|mpirun|xpk|kubectl)\b|SLURM_', 'needs a cluster (Slurm, Open MPI, Kubernetes); '
                                                    'tests/test_cluster.py and tests/test_train.py simulate one'),
    (r'\bgcloud\b|launch_tpu\.py|--topology=|_cycles\.py', 'needs a TPU, libtpu or Google Cloud; tests/test_aot.py and '
                                              'tests/test_scripts.py cover them with fakes'),
    (r'(step|loss)_cycles\.py', 'compiles for a TPU chip with libtpu (tests/test_schedule.py covers the estimate)'),
    (r'gpu.check|--preset=gpu|\.whl|cuda', 'needs an NVIDIA GPU (docs/gpu.md, make gpu-check)'),
    (r'/shared/|~/|my_task|BUCKET|REGISTRY|c4/en|data/mine|runs/mine', 'names your own data, files, bucket or image '
                                                                      '(real C4 among them)'),
    (r'^(pip|git|cd|export)\b|\bpip install\b', 'installs packages or sets up a shell'),
    (r'^make (train|test|test-fast)\b|^\S*python -m pytest', 'trains for minutes or runs the suite'),
    (r'reproduce_c4_ablation\.py|sweep\.py|benchmark\.py', 'trains or times many runs: minutes to hours'),
    (r'laurel\.(serve\.)?harness|laurel-lm-eval', "lm-evaluation-harness: tests/test_harness.py runs the shipped "
                                                 "task's command as printed and checks its scores"),
    (r'\[--', 'shows optional flags in brackets'),
]
# The trained-run fixture's context is 32 tokens: a prompt and 64 new tokens would not fit.
FIXTURE_TOKENS = '--max_new_tokens=8'


def documented_commands() -> list[tuple[str, str]]:
  """(file, command) of every command line in the code blocks of the README and docs, continuations joined and
  trailing comments dropped."""
  found = []
  for name in DOCS:
    for block in re.findall(r'^```[a-z]*\n(.*?)^```', (ROOT / name).read_text(), re.S | re.M):
      for line in block.replace('\\\n', ' ').splitlines():
        line = re.sub(r'\s+#( .*)?$', '', re.sub(r'^\s*TensorBoard\s+', '', line)).strip()
        words = [w for w in line.split() if not re.fullmatch(r'[A-Z_]+=\S*', w)]
        if words and words[0] in PROGRAMS:
          found.append((name, ' '.join(line.split())))
  return found


def skip_reason(command: str) -> str | None:
  program = re.sub(r'^([A-Z_]+=\S* )+', '', command)  # after the variables it sets
  return next((why for pattern, why in SKIPPED if re.search(pattern, command) or re.search(pattern, program)), None)


def as_run_here(command: str, python: str) -> str:
  """The command for this checkout: the venv's python and console scripts as this interpreter, a training command
  only checked (--print_config: no training), the fixture's context, TensorBoard's version (no server)."""
  words = shlex.split(command)
  scripts = {'laurel-train': 'laurel.main', 'laurel-generate': 'laurel.serve.generate', 'laurel-evaluate': 'laurel.serve.evaluate',
             'laurel-prepare-c4': 'laurel.prepare.c4', 'laurel-prepare-text': 'laurel.prepare.text',
             'tensorboard': 'tensorboard.main', '.venv/bin/tensorboard': 'tensorboard.main'}
  if words[0] in scripts:
    words = [python, '-m', scripts[words[0]], *words[1:]]
  elif words[0] in ('python', 'python3', '.venv/bin/python'):
    words[0] = python
  if 'laurel.main' in words and '--help' not in words and '--print_config' not in words:
    words.append('--print_config')
  if 'tensorboard.main' in words:
    words = words[:3] + ['--version_tb']  # starts no server
  words = [FIXTURE_TOKENS if w.startswith('--max_new_tokens=') else w for w in words]
  return shlex.join(words)


def test_every_documented_command_is_run_or_skipped_for_a_stated_reason():
  commands = documented_commands()
  assert len(commands) > 30 and {'README.md', 'docs/training.md', 'docs/evaluation.md'} <= {f for f, _ in commands}
  run = [c for _, c in commands if skip_reason(c) is None]
  # What is run: the configs and flags of the training commands, sampling and evaluating, the help, TensorBoard.
  assert any('laurel.serve.generate' in c for c in run) and any('laurel.serve.evaluate' in c for c in run)
  assert any('--help' in c for c in run) and any('tensorboard' in c for c in run)
  assert as_run_here("python -m laurel.serve.generate --workdir=runs/demo --prompt='def ' --max_new_tokens=64", 'py') == (
      "py -m laurel.serve.generate --workdir=runs/demo '--prompt=def ' --max_new_tokens=8")


@pytest.fixture(scope='module')
def demo_root(trained_run, tmp_path_factory):
  """A folder in which runs/demo is a copy of the trained-run fixture, and configs/ the repository's."""
  root = tmp_path_factory.mktemp('fresh_clone')
  shutil.copytree(trained_run, root / 'runs' / 'demo')
  (root / 'configs').symlink_to(ROOT / 'configs')
  return root


def _shell(command: str, cwd) -> subprocess.CompletedProcess:
  """`command` as a shell in which the venv is not activated runs it; laurel's command lines in this process."""
  return run_as_printed(command, cwd, {**cli_env(), 'PATH': without_this_python(cli_env()['PATH'])})


@pytest.mark.slow
def test_the_cheap_documented_commands_work_as_printed(demo_root):
  failed, results = [], {}
  for name, command in documented_commands():
    if skip_reason(command) is None:
      here = as_run_here(command, sys.executable)
      if here not in results:  # a command shown in several places runs once
        results[here] = _shell(here, demo_root)
      if (result := results[here]).returncode != 0:
        failed.append(f'{name}: {command}\n  ran: {here}\n  exit {result.returncode}: {result.stderr.strip()[-300:]}')
  assert not failed, '\n'.join(failed)


@pytest.mark.slow
def test_the_commands_a_finished_run_prints_work_as_printed_from_a_folder_with_a_space(trained_run, tmp_path):
  """metrics_log.summary's closing commands (sampling, its held-out documents, TensorBoard), run by a shell in which the
  venv is not activated, on a workdir whose path has a space."""
  workdir = tmp_path / 'my runs' / 'demo'
  shutil.copytree(trained_run, workdir)
  config = train_config.validate_config(command_line.load(str(workdir))).config  # the run's saved config, typed
  final = json.loads((workdir / 'final.json').read_text())
  lines = metrics_log.summary(dataclasses.replace(config, tensorboard=True), epath.Path(workdir), final, 1.0).splitlines()
  commands = [l.strip() for l in lines[lines.index('next:') + 1:]]
  commands.append(next(l for l in lines if l.strip().startswith('TensorBoard')).split(None, 1)[1] + ' --version_tb')
  assert len(commands) == 3
  for command in commands:  # from the folder the run printed them in: its python command may be relative to it
    result = _shell(command, os.getcwd())
    assert result.returncode == 0, f'{command}\n{result.stderr[-2000:]}'
  assert json.loads((workdir / 'eval_held_out.json').read_text())['documents'] > 0


# What the docs say agrees with the code and with each other (issue 60's first-hour findings).

def test_the_quick_start_runs_the_quick_tests_before_the_whole_suite():
  readme = (ROOT / 'README.md').read_text()
  block = re.search(r'## Quick start\n\n```\n(.*?)```', readme, re.S).group(1)
  assert [line.split('#')[0].strip() for line in block.splitlines()] == ['make train', 'make test-fast', 'make test']


def test_the_docs_pass_the_papers_c4_to_the_ablation_one_way():
  """--data_path, which the paper preset requires (scripts/reproduce_c4_ablation.py); docs/tpu.md passed --set."""
  paper = [(name, c) for name, c in documented_commands() if 'reproduce_c4_ablation.py' in c and '--preset=paper' in c]
  assert {name for name, _ in paper} >= {'docs/tpu.md', 'docs/reproducing.md'}
  assert all('--data_path=' in c and '--set=data.path' not in c for _, c in paper), paper


def test_the_docs_name_the_file_that_holds_the_design_record():
  designs_doc = (ROOT / 'docs' / 'designs.md').read_text()
  linked = set(re.findall(r'\(\.\./(laurel/designs/\w+\.py)\)', ' '.join(
      re.findall(r'(?:protocol and registry of|`Design` record in the registry of)\s*\[[^\]]+\]\([^)]+\)',
                 designs_doc))))
  assert linked == {'laurel/designs/protocol.py'}
  assert re.search(r'^class Design\b', (ROOT / linked.pop()).read_text(), re.M)


def test_the_training_doc_lists_every_preset_of_table_5():
  with pytest.raises(config_lib.InputError) as refused:
    command_line.load('c4_ablation:rw_lr,preset=none')
  presets = re.search(r'must be one of (.+)$', str(refused.value)).group(1).split(', ')
  row = next(l for l in (ROOT / 'docs' / 'training.md').read_text().splitlines() if l.startswith('| `configs/c4_'))
  assert len(presets) == 4 and all(f'`{p}`' in row or f'`preset={p}`' in row for p in presets), (presets, row)


def test_the_gpu_pages_say_what_a_user_runs_and_the_device_it_was_measured_on():
  """Not a maintainer's runbook: no borrowed GPU, no time limit of a session, no `the prepared call`."""
  pages = {name: (ROOT / name).read_text() for name in ('results/README.md', 'docs/gpu.md')}
  for name, text in pages.items():
    for phrase in ('lent for', 's limit', 'prepared GPU call', 'the next GPU'):
      assert phrase not in text, (name, phrase)
  gpu_section = pages['results/README.md'].split('## Table 5 on one GPU')[1].split('\n## ')[0]
  assert 'Measured on one H200, jax 0.11.2' in gpu_section
  help_text = ast.get_docstring(ast.parse((ROOT / 'scripts' / 'reproduce_c4_ablation.py').read_text()))  # its --help
  assert 'what one H200 measured: results/README.md' in ' '.join(help_text.split())
