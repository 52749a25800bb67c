"""lm-evaluation-harness backend `laurel`: scores the latest checkpoint of an LM run on lm_eval's tasks.

  python -m laurel.harness --model laurel --model_args workdir=RUN --tasks TASK [...] [any lm_eval flag]

lm-eval 0.4.13 (the release on PyPI) reads no plug-in entry points: this command registers the backend and runs
lm_eval's own command line (`laurel-lm-eval` is the same). lm-eval releases with plug-ins find the backend through
this package's `lm_eval.models` entry point, so there `lm_eval --model laurel ...` works as is. From Python:
`import laurel.harness`, then `lm_eval.simple_evaluate(model='laurel', model_args={'workdir': RUN}, ...)`.

Every request runs on the run's mesh with its parameters sharded as in training (checkpoint.lm_run_on_mesh), as in
laurel.evaluate:
  loglikelihood          laurel.evaluate's scorer and tokenisation (evaluate.choice_sequence): context and
                         continuation tokenised apart, the context cut from the left to fit seq_len, an empty context
                         is the end-of-document token; is_greedy when every continuation token is the argmax.
  loglikelihood_rolling  each token of the text predicted once, the first after the end-of-document token, in
                         windows of seq_len with as much context as fits (lm_eval's rolling windows).
  generate_until         laurel.generate's greedy decoding with the KV cache: max_gen_toks (default 256) new tokens
                         after the context cut from the left to seq_len - max_gen_toks, ended at the first stop string
                         of `until` and at the end-of-document token. Sampling is refused. Batches are padded
                         to --batch_size rows and their prompts to a multiple of 64 tokens, so a task compiles
                         once per length bucket, not once per batch.
--batch_size (lm_eval's flag, default 1; 'auto' = 16) is rounded up to the data-parallel devices; --device is unused
(the devices are the run's mesh).
"""

import contextlib

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from tqdm import tqdm

try:
  import lm_eval.models  # noqa: F401  # the built-in backends first: 0.4.13 adds them only to an empty registry
  from lm_eval import utils as lm_eval_utils
  from lm_eval.api.model import LM
  from lm_eval.api.registry import register_model
except ImportError as e:
  raise ImportError("laurel.harness needs lm-evaluation-harness: pip install -e '.[lm_eval]'") from e

from laurel import checkpoint, compile_cache, config_lib, data, evaluate, generate

AUTO_BATCH_SIZE = 16
PREFILL_BUCKET = 64  # generate_until's prompts are padded to a multiple of this: one compile per bucket and length
DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's own default for generate_until


class BadInput(config_lib.InputError):
  """An input error the command line reports in one line."""


def _batch_size(value) -> int:
  text = str(value)
  if text.startswith('auto'):
    return AUTO_BATCH_SIZE
  if not text.isdigit() or int(text) < 1:
    raise BadInput(f'--batch_size={value!r}: a positive integer or auto')
  return int(text)


@register_model('laurel')
class LaurelLM(LM):
  """An LM run's latest checkpoint. lm_eval passes its --batch_size, --max_batch_size and --device here too."""

  def __init__(self, workdir: str | None = None, batch_size=1, max_batch_size=None, device=None, **unknown):
    del max_batch_size, device  # one fixed batch shape, one compile; the devices are the run's mesh
    super().__init__()
    if unknown:
      raise BadInput(f'--model_args {", ".join(f"{k}={v}" for k, v in unknown.items())}: the laurel backend takes '
                     'workdir=RUN only')
    if not workdir:
      raise BadInput('--model_args workdir=RUN is required: the LM run to score')
    batch_size = _batch_size(batch_size)
    try:
      with checkpoint.lm_run_on_mesh(workdir) as (task, params, step, mesh):
        self.tokenizer = data.make_tokenizer(task.config.data)
        self._scorer = evaluate.make_scorer(task, params, mesh, self.tokenizer, batch_size)
    except config_lib.InputError as e:
      raise BadInput(str(e)) from None
    self.workdir, self.step, self.seq_len, self.batch_size = workdir, step, task.config.data.seq_len, batch_size
    self._model_cfg, self._params, self._mesh = task.model_cfg, params, mesh
    self._rules = task.config.logical_axis_rules

  @contextlib.contextmanager
  def _on_mesh(self):
    """Where the scorer and the sampler trace and run: the run's mesh and logical axis rules."""
    with jax.set_mesh(self._mesh), nn.logical_axis_rules(self._rules):
      yield

  def _score(self, sequences, desc: str, disable_tqdm: bool):
    with self._on_mesh(), tqdm(total=len(sequences), desc=desc, disable=disable_tqdm) as bar:
      return self._scorer.score(sequences, progress=bar.update)

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    sequences = [evaluate.choice_sequence(self.tokenizer, self.seq_len, *r.args) for r in requests]
    logliks, greedy = self._score(sequences, 'laurel loglikelihood', disable_tqdm)
    results = [(float(ll), bool(g)) for ll, g in zip(logliks, greedy)]
    for request, result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood', request.args, result)
    return results

  def rolling_windows(self, text: str) -> list[tuple[list[int], int]]:
    """(tokens, first scored position) per window of `text`: together they score each token once."""
    # A window of seq_len tokens scores its last seq_len - 1 positions, so lm_eval's windows hold seq_len - 1.
    windows = lm_eval_utils.get_rolling_token_windows(self.tokenizer.encode(text), self.tokenizer.eos_id,
                                                      self.seq_len - 1, 1)
    return [(context + scored, len(context)) for context, scored in map(lm_eval_utils.make_disjoint_window, windows)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    sequences, owners = [], []
    for i, request in enumerate(requests):
      windows = self.rolling_windows(request.args[0])
      sequences += windows
      owners += [i] * len(windows)
    logliks, _ = self._score(sequences, 'laurel loglikelihood_rolling', disable_tqdm)
    totals = np.bincount(np.asarray(owners, np.int64), weights=logliks, minlength=len(requests))
    results = [float(t) for t in totals]
    for request, result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood_rolling', request.args, result)
    return results

  def generation_settings(self, gen_kwargs: dict) -> tuple[tuple[str, ...], int]:
    """(stop strings, max new tokens) of one request's generation kwargs; BadInput for what greedy decoding within
    seq_len cannot do."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop('until', None) or []
    until = (until,) if isinstance(until, str) else tuple(until)
    max_new = kwargs.pop('max_gen_toks', DEFAULT_MAX_GEN_TOKS)
    do_sample, temperature = kwargs.pop('do_sample', False), kwargs.pop('temperature', 0.0)
    if do_sample or temperature:
      raise BadInput(f'generate_until: do_sample={do_sample}, temperature={temperature}: the laurel backend decodes '
                     'greedily (do_sample=False, temperature=0)')
    if kwargs:
      raise BadInput(f'generate_until: {", ".join(f"{k}={v!r}" for k, v in kwargs.items())}: not supported by the '
                     'laurel backend, which takes until, max_gen_toks, do_sample=False and temperature=0')
    if not isinstance(max_new, int) or not 1 <= max_new < self.seq_len:
      raise BadInput(f'generate_until: max_gen_toks={max_new!r}: must be in [1, {self.seq_len}), below the run\'s '
                     f'data.seq_len={self.seq_len} so that the context keeps a token (--gen_kwargs max_gen_toks=N)')
    return until, max_new

  def _prompt(self, context: str, max_new: int) -> list[int]:
    ids = self.tokenizer.encode(context) or [self.tokenizer.eos_id]
    return ids[-(self.seq_len - max_new):]

  def _continuation(self, ids, until: tuple[str, ...]) -> str:
    ids = [int(i) for i in ids]
    if self.tokenizer.eos_id in ids:  # the continuation ends at the end of its document
      ids = ids[:ids.index(self.tokenizer.eos_id)]
    text = self.tokenizer.decode(ids)
    return text[:min((text.find(s) for s in until if s and s in text), default=len(text))]

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    settings = [self.generation_settings(r.args[1]) for r in requests]  # every request checked before compiling
    groups = {}
    for i, setting in enumerate(settings):
      groups.setdefault(setting, []).append(i)
    results = [''] * len(requests)
    with self._on_mesh(), tqdm(total=len(requests), desc='laurel generate_until', disable=disable_tqdm) as bar:
      for (until, max_new), indices in groups.items():
        for start in range(0, len(indices), self.batch_size):
          batch = indices[start:start + self.batch_size]
          prompts = [self._prompt(requests[i].args[0], max_new) for i in batch]
          longest = max(map(len, prompts))  # at most seq_len - max_new: _prompt cuts the context to fit
          prefill = min(-(-longest // PREFILL_BUCKET) * PREFILL_BUCKET, self.seq_len - max_new)
          prompts += [[self.tokenizer.eos_id]] * (self.batch_size - len(batch))  # the last batch: the same shape
          new_BxN, _ = generate.generate(self._model_cfg, self._params, prompts, max_new,
                                         pad_id=self.tokenizer.pad_id, prefill_len=prefill)
          for i, row in zip(batch, new_BxN):
            results[i] = self._continuation(row, until)
            self.cache_hook.add_partial('generate_until', requests[i].args, results[i])
          bar.update(len(batch))
    return results


def run():
  """lm_eval's command line with the `laurel` backend registered; our input errors in one line."""
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  compile_cache.setup()  # lm_eval parses its own arguments: JAX_COMPILATION_CACHE_DIR moves it
  try:
    cli_evaluate()
  except BadInput as e:
    config_lib.fail(str(e))


if __name__ == '__main__':
  run()
