"""lm-evaluation-harness backend `laurel` for an LM run's latest checkpoint (docs/evaluation.md):
`python -m laurel.serve.harness --model laurel --model_args workdir=RUN --tasks TASK` registers it (lm-eval 0.4.13 reads no
plug-in entry points) and runs lm_eval's command line."""

import contextlib

import flax.linen as nn
import jax
import numpy as np
from tqdm import tqdm

try:
  import lm_eval.models  # noqa: F401  # the built-in backends first: 0.4.13 adds them only to an empty registry
  from lm_eval import utils as lm_eval_utils
  from lm_eval.api.model import LM
  from lm_eval.api.registry import register_model
except ImportError as e:
  raise ImportError("laurel.serve.harness needs lm-evaluation-harness: pip install -e '.[lm_eval]'") from e

from laurel import data
from laurel.config_lib import InputError
from laurel.serve import evaluate, generate, loader

AUTO_BATCH_SIZE = 16
PREFILL_BUCKET = 64  # generate_until's prompts are padded to a multiple of this: one compile per bucket and length
DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's own default for generate_until


@register_model('laurel')
class LaurelLM(LM):
  """An LM run's latest checkpoint, scored as laurel.serve.evaluate scores and decoded greedily as laurel.serve.generate does.
  lm_eval passes its --batch_size ('auto' = 16), --max_batch_size and --device here too; its --trust_remote_code (or
  trust_design_file=True in --model_args) lets the run's design file be imported (laurel.train_config)."""

  def __init__(self, workdir: str | None = None, batch_size=1, max_batch_size=None, device=None,
               trust_remote_code=False, trust_design_file=False, **unknown):
    del max_batch_size, device  # one fixed batch shape, one compile; the devices are the run's mesh
    super().__init__()
    if unknown:
      raise InputError(f'--model_args {", ".join(f"{k}={v}" for k, v in unknown.items())}: the laurel backend takes '
                       'workdir=RUN and trust_design_file=True only')
    if not workdir:
      raise InputError('--model_args workdir=RUN is required: the LM run to score')
    if str(batch_size).startswith('auto'):
      batch_size = AUTO_BATCH_SIZE
    elif not str(batch_size).isdigit() or int(batch_size) < 1:
      raise InputError(f'--batch_size={batch_size!r}: a positive integer or auto')
    trust = any(str(flag).lower() in ('true', '1') for flag in (trust_remote_code, trust_design_file))
    with loader.lm_run_on_mesh(workdir, trust) as (task, params, step, mesh):
      self.tokenizer = data.make_tokenizer(task.config.data)
      self._scorer = evaluate.make_scorer(task, params, mesh, self.tokenizer, int(batch_size))
    self.workdir, self.step, self.seq_len, self.batch_size = workdir, step, task.config.data.seq_len, int(batch_size)
    self._model_cfg, self._params, self._mesh = task.model_cfg, params, mesh
    self._rules = task.config.logical_axis_rules

  @contextlib.contextmanager
  def _on_mesh(self, total: int, desc: str, disable_tqdm: bool):
    """The run's mesh and logical axis rules, where the scorer and the sampler run, with a progress bar."""
    with jax.set_mesh(self._mesh), nn.logical_axis_rules(self._rules):
      with tqdm(total=total, desc=f'laurel {desc}', disable=disable_tqdm) as bar:
        yield bar

  def _cached(self, kind: str, requests, results: list) -> list:
    for request, result in zip(requests, results):
      self.cache_hook.add_partial(kind, request.args, result)
    return results

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    sequences = [evaluate.choice_sequence(self.tokenizer, self.seq_len, *r.args) for r in requests]
    with self._on_mesh(len(sequences), 'loglikelihood', disable_tqdm) as bar:
      logliks, greedy = self._scorer(sequences, progress=bar.update)
    return self._cached('loglikelihood', requests, [(float(ll), bool(g)) for ll, g in zip(logliks, greedy)])

  def rolling_windows(self, text: str) -> list[tuple[list[int], int]]:
    """(tokens, first scored position) per window of `text`: together they score each token once."""
    # A window of seq_len tokens scores its last seq_len - 1 positions, so lm_eval's windows hold seq_len - 1.
    windows = lm_eval_utils.get_rolling_token_windows(self.tokenizer.encode(text), self.tokenizer.eos_id,
                                                      self.seq_len - 1, 1)
    return [(context + scored, len(context)) for context, scored in map(lm_eval_utils.make_disjoint_window, windows)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows = [self.rolling_windows(request.args[0]) for request in requests]
    owners = np.repeat(np.arange(len(requests)), [len(w) for w in windows])
    with self._on_mesh(len(owners), 'loglikelihood_rolling', disable_tqdm) as bar:
      logliks, _ = self._scorer([w for ws in windows for w in ws], progress=bar.update)
    totals = np.bincount(owners, weights=logliks, minlength=len(requests))
    return self._cached('loglikelihood_rolling', requests, [float(t) for t in totals])

  def generation_settings(self, gen_kwargs: dict) -> tuple[tuple[str, ...], int]:
    """(stop strings, max new tokens) of a request; InputError for what greedy decoding within seq_len cannot do."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop('until', None) or []
    until = (until,) if isinstance(until, str) else tuple(until)
    max_new = kwargs.pop('max_gen_toks', DEFAULT_MAX_GEN_TOKS)
    do_sample, temperature = kwargs.pop('do_sample', False), kwargs.pop('temperature', 0.0)
    if do_sample or temperature:
      raise InputError(f'generate_until: do_sample={do_sample}, temperature={temperature}: the laurel backend '
                       'decodes greedily (do_sample=False, temperature=0)')
    if kwargs:
      raise InputError(f'generate_until: {", ".join(f"{k}={v!r}" for k, v in kwargs.items())}: not supported by the '
                       'laurel backend, which takes until, max_gen_toks, do_sample=False and temperature=0')
    if not isinstance(max_new, int) or not 1 <= max_new < self.seq_len:
      raise InputError(f'generate_until: max_gen_toks={max_new!r}: must be in [1, {self.seq_len}), below the run\'s '
                       f'data.seq_len={self.seq_len} so that the context keeps a token (--gen_kwargs max_gen_toks=N)')
    return until, max_new

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy continuations of the contexts (cut from the left to seq_len - max_gen_toks) up to a stop string or the
    end-of-document token; padded batches and prompt lengths (PREFILL_BUCKET) compile once per length bucket."""
    settings = [self.generation_settings(r.args[1]) for r in requests]  # every request checked before compiling
    groups = {}
    for i, setting in enumerate(settings):
      groups.setdefault(setting, []).append(i)
    results, eos = [''] * len(requests), self.tokenizer.eos_id
    with self._on_mesh(len(requests), 'generate_until', disable_tqdm) as bar:
      for (until, max_new), indices in groups.items():
        for start in range(0, len(indices), self.batch_size):
          batch = indices[start:start + self.batch_size]
          prompts = [(self.tokenizer.encode(requests[i].args[0]) or [eos])[-(self.seq_len - max_new):] for i in batch]
          prefill = min(-(-max(map(len, prompts)) // PREFILL_BUCKET) * PREFILL_BUCKET, self.seq_len - max_new)
          prompts += [[eos]] * (self.batch_size - len(batch))  # the last batch: the same shape
          new_BxN, _ = generate.generate(self._model_cfg, self._params, prompts, max_new,
                                         pad_id=self.tokenizer.pad_id, prefill_len=prefill)
          for i, row in zip(batch, new_BxN):
            text = self.tokenizer.decode(generate.until_eos(row, eos)[0])
            results[i] = text[:min((text.find(s) for s in until if s and s in text), default=len(text))]
          bar.update(len(batch))
    return self._cached('generate_until', requests, results)


def run():
  """lm_eval's command line with the `laurel` backend registered; our input errors in one line."""
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel
  evaluate.run_main(cli_evaluate)  # lm_eval parses its own arguments: JAX_COMPILATION_CACHE_DIR moves the cache


if __name__ == '__main__':
  run()
