"""Log-likelihood evaluation of an LM checkpoint (docs/evaluation.md): `python -m laurel.serve.evaluate --workdir=DIR
--task=TASK ... [--trust_design_file]` scores the run's own held_out split, text:GLOB, a multiple-choice .jsonl file
or a TFDS task into DIR/eval_<task>.json."""

import contextlib
import glob
import importlib
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from etils import epath

from laurel import config_lib, data, sharding, train_config
from laurel.config_lib import InputError
from laurel.cli import compile_cache, console, process
from laurel.cli.files import write_text_atomic
from laurel.serve import loader

HELD_OUT = 'held_out'  # the task of the run's own validation split (held_out_task)


class Scorer:
  """Sum of log p(token) over the scored positions of padded sequences, `batch_size` at a time, one jit."""

  def __init__(self, model, params, seq_len: int, batch_size: int, pad_id: int, batch_sharding=None):
    self.seq_len, self.batch_size, self.pad_id, self.batch_sharding = seq_len, batch_size, pad_id, batch_sharding
    self.params = params

    @jax.jit  # params are arguments: closed over, they would be constants of the compiled program
    def logprobs(params, tokens_BxL, weights_BxL):
      logits_BxLxV = model.apply({'params': params}, tokens_BxL)[:, :-1]
      logp_BxL = jnp.take_along_axis(jax.nn.log_softmax(logits_BxLxV), tokens_BxL[:, 1:, None], axis=-1)[..., 0]
      scored_BxL = weights_BxL[:, 1:] > 0
      greedy_B = jnp.all((jnp.argmax(logits_BxLxV, -1) == tokens_BxL[:, 1:]) | ~scored_BxL, axis=-1)
      return (logp_BxL * weights_BxL[:, 1:]).sum(-1), greedy_B
    self._logprobs = logprobs

  def __call__(self, sequences: list[tuple[list[int], int]], progress=None) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence (tokens, first scored position): the summed log-likelihood of tokens[first:] and whether each
    of those tokens is the argmax; `progress(n)` is told of each batch's n sequences."""
    logliks, greedy = [np.zeros(0)], [np.zeros(0, bool)]
    for start in range(0, len(sequences), self.batch_size):
      chunk = sequences[start:start + self.batch_size]
      tokens = np.full((self.batch_size, self.seq_len), self.pad_id, np.int32)
      weights = np.zeros((self.batch_size, self.seq_len), np.float32)
      for b, (seq, first) in enumerate(chunk):
        tokens[b, :len(seq)] = seq
        weights[b, first:len(seq)] = 1.0
      if self.batch_sharding is not None:  # rows over the data-parallel devices, as in training
        tokens, weights = jax.device_put((tokens, weights), self.batch_sharding)
      loglik_B, greedy_B = self._logprobs(self.params, tokens, weights)
      logliks.append(np.asarray(loglik_B[:len(chunk)], np.float64))
      greedy.append(np.asarray(greedy_B[:len(chunk)]))
      if progress is not None:
        progress(len(chunk))
    return np.concatenate(logliks), np.concatenate(greedy)


def make_scorer(task, params, mesh, tokenizer, batch_size: int) -> Scorer:
  """The scorer of an LM run on its mesh, `batch_size` rounded up to the data-parallel devices it is sharded over."""
  rows = mesh.shape['data'] * mesh.shape['fsdp']
  return Scorer(task.model, params, task.config.data.seq_len, -(-batch_size // rows) * rows, tokenizer.pad_id,
                sharding.batch_sharding(mesh))


def text_task(scorer: Scorer, tokenizer, pattern: str, max_items: int) -> dict:
  """Perplexity and bits per byte of files, each one document (document_scores)."""
  files = sorted(pathlib.Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
  if not files:
    raise InputError(f'--task=text:{pattern}: matches no files')
  files = files[:max_items or None]
  texts = [path.read_text(encoding='utf-8', errors='replace') for path in files]
  return {'files': len(files), **document_scores(scorer, tokenizer, texts)}


def held_out_task(scorer: Scorer, tokenizer, data_cfg, max_items: int) -> dict:
  """document_scores of the run's own validation split, in its order: the files it held out (text), its eval_split
  (c4, corpus) or its synthetic validation documents."""
  source = data._source(data_cfg, train=False)  # pylint: disable=protected-access  # the documents the loop evaluates
  records = [source[i] for i in range(min(len(source), max_items or len(source)))]
  texts = [record['text'] if isinstance(record, dict) else record for record in records]  # a TFDS C4 example
  texts = [text.decode('utf-8', errors='replace') if isinstance(text, bytes) else text for text in texts]
  return {'documents': len(texts), **document_scores(scorer, tokenizer, texts)}


def document_scores(scorer: Scorer, tokenizer, texts: list[str]) -> dict:
  """Perplexity and bits per byte of documents, each in windows of seq_len overlapping by one token."""
  windows, tokens, num_bytes = [], 0, 0
  for text in texts:
    ids = list(tokenizer.document(text))
    num_bytes += len(text.encode('utf-8')) - len(tokenizer.decode(ids[:1]).encode('utf-8'))
    tokens += len(ids) - 1
    for start in range(0, len(ids) - 1, scorer.seq_len - 1):  # it predicts ids[start+1 : start+seq_len]
      windows.append((ids[start:start + scorer.seq_len], 1))
  nll = -float(scorer(windows)[0].sum())
  return {'tokens': tokens, 'bytes': num_bytes, 'nll_per_token': nll / tokens,
          'perplexity': math.exp(nll / tokens), 'bits_per_byte': nll / math.log(2) / num_bytes}


def jsonl_items(path: str, max_items: int) -> list:
  """[([(context, continuation) per choice], label)] of a JSONL multiple-choice file."""
  lines = [l for l in epath.Path(path).read_text().splitlines() if l.strip()]
  items = []
  for n, line in enumerate(lines[:max_items or None], 1):
    try:
      item = json.loads(line)
      context, choices, label = str(item['context']), [str(c) for c in item['choices']], int(item['label'])
    except (ValueError, KeyError, TypeError) as e:
      raise InputError(f'--task={path}: line {n} is not {{"context": str, "choices": [str, ...], "label": int}} '
                       f'({type(e).__name__})') from None
    if not choices or not 0 <= label < len(choices):
      raise InputError(f'--task={path}: line {n}: label {label} is not an index of its {len(choices)} choices')
    items.append(([(context, c) for c in choices], label))
  return items


def _text(value) -> str:
  return value.decode('utf-8') if isinstance(value, bytes) else str(value)


def _arc(e):
  labels = list(np.asarray(e['choices']['label']))
  answer = int(e['answerKey'])
  question = f"Question: {_text(e['question'])}\nAnswer:"
  return [(question, ' ' + _text(t)) for t in e['choices']['text']], labels.index(answer) if answer in labels else -1


def _winogrande(e):
  before, _, after = _text(e['sentence']).partition('_')
  return [(before + _text(e[o]), after) for o in ('option1', 'option2')], int(e['label'])


# name -> (TFDS name, split, example -> ([(context, continuation) per choice], label)); prompts as the harness's.
TFDS_TASKS = {
    'hellaswag': ('hellaswag', 'validation', lambda e: (
        [(_text(e['context']), ' ' + _text(x)) for x in e['endings']], int(e['label']))),
    'piqa': ('piqa', 'validation', lambda e: (
        [(f"Question: {_text(e['goal'])}\nAnswer:", ' ' + _text(e[s])) for s in ('sol1', 'sol2')], int(e['label']))),
    'arc_easy': ('ai2_arc/ARC-Easy', 'test', _arc),
    'arc_challenge': ('ai2_arc/ARC-Challenge', 'test', _arc),
    'winogrande': ('winogrande', 'validation', _winogrande),
}


def tfds_items(name: str, data_dir: str, max_items: int) -> list:
  tfds = config_lib.optional_import('tensorflow_datasets', 'tfds', f'--task={name}')
  tfds_name, split, item = TFDS_TASKS[name]
  with contextlib.suppress(ImportError):  # tensorflow_datasets.text's builders register on import, not with tfds
    importlib.import_module(f'tensorflow_datasets.text.{tfds_name.split("/")[0]}')
  try:
    source = tfds.data_source(tfds_name, split=split, data_dir=data_dir or None, download=False)
  except Exception as e:  # pylint: disable=broad-except  # TFDS raises several types for data not prepared
    raise InputError(f'--task={name}: no prepared {tfds_name} ({split}) in --tfds_data_dir={data_dir!r}; prepare it '
                     f'where TFDS can download: tfds build {tfds_name.split("/")[0]} ({type(e).__name__})') from None
  items = [item(source[i]) for i in range(min(len(source), max_items or len(source)))]
  return [(pairs, label) for pairs, label in items if 0 <= label < len(pairs)]


def choice_sequence(tokenizer, seq_len: int, context: str, continuation: str) -> tuple[list[int], int]:
  """(tokens, first scored position) scoring `continuation` (cut to seq_len - 1 tokens) given `context` (cut from
  the left); an empty context is the end-of-document token, as before a document in training."""
  ctx, cont = tokenizer.encode(context) or [tokenizer.eos_id], tokenizer.encode(continuation)[:seq_len - 1]
  keep = ctx[max(0, len(ctx) - (seq_len - len(cont))):]
  return keep + cont, len(keep)


def choice_task(scorer: Scorer, tokenizer, items: list) -> dict:
  """Accuracy, accuracy normalised by each choice's bytes, and the correct choice's mean log-likelihood."""
  if not items:
    raise InputError('multiple choice: no items')
  sequences = [choice_sequence(tokenizer, scorer.seq_len, context, choice) for pairs, _ in items
               for context, choice in pairs]
  logliks = np.split(scorer(sequences)[0], np.cumsum([len(pairs) for pairs, _ in items])[:-1])
  num_bytes = [np.array([max(len(c.encode('utf-8')), 1) for _, c in pairs]) for pairs, _ in items]
  labels = [label for _, label in items]
  mean = lambda values: float(np.mean(values))
  return {'items': len(items), 'accuracy': mean([np.argmax(ll) == y for ll, y in zip(logliks, labels)]),
          'accuracy_norm': mean([np.argmax(ll / n) == y for ll, n, y in zip(logliks, num_bytes, labels)]),
          'correct_loglik': mean([ll[y] for ll, y in zip(logliks, labels)])}


def task_name(task: str) -> str:
  """The name results go under: text:DIR/*.txt -> DIR's name (the glob's last part without a wildcard),
  text:a/valid.txt and a/mc.jsonl -> the file's stem, a TFDS task -> itself."""
  if task.startswith('text:'):
    parts = pathlib.PurePath(task[5:]).parts
    fixed = [p for p in parts if not glob.has_magic(p)]
    name = pathlib.PurePath(fixed[-1]).stem if fixed and fixed[-1] == parts[-1] else fixed[-1] if fixed else 'text'
  else:
    name = task if task in TFDS_TASKS or task == HELD_OUT else pathlib.Path(task).stem
  return re.sub(r'[^A-Za-z0-9_.-]+', '_', name).strip('_') or 'task'


def check_task(task: str) -> None:
  """A one-line InputError unless `task` is held_out, text:GLOB, an existing JSONL file or a TFDS task."""
  if not task.startswith('text:') and task not in (HELD_OUT, *TFDS_TASKS) and not epath.Path(task).is_file():
    raise InputError(f'--task={task!r}: not {HELD_OUT}, text:GLOB, an existing .jsonl file, nor one of '
                     f'{", ".join(TFDS_TASKS)}')


def evaluate_run(workdir, tasks, batch_size: int = 16, max_items: int = 0, tfds_data_dir: str = '',
                 trust_design_file: bool = False):
  """Scores the run's latest checkpoint on each task, yielding each result once written to eval_<task name>.json."""
  with loader.lm_run_on_mesh(workdir, trust_design_file) as (task, params, step, mesh):
    tokenizer = data.make_tokenizer(task.config.data)
    scorer = make_scorer(task, params, mesh, tokenizer, batch_size)
    for spec in tasks:
      if spec == HELD_OUT:
        result = held_out_task(scorer, tokenizer, task.config.data, max_items)
      elif spec.startswith('text:'):
        result = text_task(scorer, tokenizer, spec[5:], max_items)
      else:
        items = tfds_items(spec, tfds_data_dir, max_items) if spec in TFDS_TASKS else jsonl_items(spec, max_items)
        result = choice_task(scorer, tokenizer, items)
      result = {'task': task_name(spec), 'spec': spec, 'checkpoint': step, **result}
      with process.deferred():  # Ctrl-C never leaves half a file
        write_text_atomic(epath.Path(workdir) / f'eval_{result["task"]}.json', json.dumps(result, indent=2) + '\n')
      yield result


def run_main(main) -> None:
  """`main()` with the compile cache on and an InputError as one line (laurel-lm-eval: lm_eval parses its own
  arguments)."""
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  compile_cache.setup()
  try:
    main()
  except InputError as e:
    process.fail(str(e))


def serving_flags(workdir_help: str) -> flags.FlagValues:
  """The flags every serving command has (--workdir, --trust_design_file, --compilation_cache), afresh for one command
  line: a command's own FlagValues, parsed once per call of its main(argv)."""
  fv = flags.FlagValues()
  flags.DEFINE_string('workdir', None, workdir_help, flag_values=fv)
  flags.DEFINE_bool('trust_design_file', False, train_config.TRUST_HELP, flag_values=fv)
  flags.DEFINE_string('compilation_cache', None, compile_cache.HELP, flag_values=fv)
  return fv


def command_main(fv: flags.FlagValues, argv: Sequence[str], body: Callable[[flags.FlagValues], None],
                 required: Sequence[str], doc: str) -> int:
  """`body(fv)` as the command line `argv` (the program first) runs it, its flags parsed into `fv` (serving_flags and
  the command's own), with the compile cache on and absl's warnings only: 0 when done; --help shows `doc` and the
  flags; a bad flag, a stray argument, a missing `required` flag or an InputError is one line `error: ...` on stderr
  and status 2; anything else keeps its traceback."""
  if {'--help', '-h', '-?', '--helpshort', '--helpfull'} & set(argv[1:]):
    described = fv.get_help(include_special_flags=False).splitlines()
    print('\n'.join([doc.rstrip(), '', 'flags:', *(line for line in described if line.startswith(' '))]))
    return 0

  def parsed_and_run():
    try:
      if len(rest := fv(list(argv))) > 1:
        raise InputError(f'unexpected arguments: {" ".join(rest[1:])}')
      for name in required:
        if not fv[name].value:
          raise InputError(f'--{name} is required')
      logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
      compile_cache.setup(fv.compilation_cache)
      body(fv)
    except (flags.Error, InputError) as e:
      process.fail(str(e).removeprefix('flag '))
  return process.exit_status(parsed_and_run)


def _evaluate(fv: flags.FlagValues) -> None:
  for task in fv.task:
    check_task(task)
  for result in evaluate_run(fv.workdir, fv.task, fv.batch_size, fv.max_items, fv.tfds_data_dir,
                             fv.trust_design_file):
    print(json.dumps(result), flush=True)


def define_flags() -> flags.FlagValues:
  """laurel-evaluate's flags, afresh for one command line."""
  fv = serving_flags('The LM run to evaluate.')
  flags.DEFINE_multi_string('task', [], f"{HELD_OUT} (the run's own validation split), text:GLOB, a .jsonl "
                            'multiple-choice file or a TFDS task (repeatable).', flag_values=fv)
  flags.DEFINE_string('tfds_data_dir', '', "TFDS's data_dir for the TFDS tasks ('' = its default).", flag_values=fv)
  flags.DEFINE_integer('batch_size', 16, 'Sequences per forward pass.', lower_bound=1, flag_values=fv)
  flags.DEFINE_integer('max_items', 0, 'Score at most this many documents, files or items (0 = all).',
                       lower_bound=0, flag_values=fv)
  return fv


def main(argv: Sequence[str]) -> int:
  """laurel-evaluate's command line `argv` (the program first) in this process: its exit status."""
  return command_main(define_flags(), argv, _evaluate, ['workdir', 'task'], __doc__)


def run():  # laurel-evaluate, python -m laurel.serve.evaluate
  console.run_command(main, 'interrupted: exited (the eval_<task>.json files written so far are complete)')


if __name__ == '__main__':
  run()
