"""A shared run is data, not code (issue 60): the design file a copied run's config.json names is imported only with
the user's word (--trust_design_file, or the module on the user's own Python path) and only while its hash is the one
the run recorded; --print_config imports nothing; the data and vocabulary paths a run names are shown before they are
read."""
import hashlib
import json
import sys

import pytest

from helpers import ROOT, TINY_LM, call_main, load_config
from laurel import command_line, config_lib, designs, main, train_config
from laurel.config_lib import InputError
from laurel.serve import evaluate, generate, loader

DESIGN = 'shared_gated:shared_gate'
# A design file as a colleague's run could carry one: it writes a marker when it runs, then registers a design.
HOSTILE = '''import pathlib
pathlib.Path({marker!r}).write_text('ran')
{design}'''


@pytest.fixture
def shared_run(tmp_path):
  """A copied run directory whose config.json names DESIGN and, as its design_file, shared_gated.py in the run's own
  folder (with its hash); (run, marker), the marker being the file that the design file writes if it ever runs."""
  run, marker = tmp_path / 'copied_run', tmp_path / 'executed'
  run.mkdir()
  design = (ROOT / 'tests' / 'gated_design.py').read_text().replace("Design('gated'", "Design('shared_gate'")
  (run / 'shared_gated.py').write_text(HOSTILE.format(marker=str(marker), design=design))
  saved = config_lib.to_dict(train_config.build_config(load_config('configs/c4_ablation.py:baseline_24,preset=tiny')))
  saved['model'] = {**saved['model'], 'stream': {'design': DESIGN}, 'shared_gate': {'gate': 'scalar', 'init': 0.0}}
  saved['design_file'] = str(run / 'shared_gated.py')
  saved['design_sha256'] = hashlib.sha256((run / 'shared_gated.py').read_bytes()).hexdigest()
  (run / 'config.json').write_text(json.dumps(saved, indent=2))
  yield run, marker
  designs.REGISTRY.pop('shared_gate', None)  # other tests enumerate every design
  sys.modules.pop('shared_gated', None)


def refusal(run) -> str:
  return (f"model.stream.design='{DESIGN}': shared_gated is not on your Python path, and the run names its file "
          f'{run / "shared_gated.py"}, which would run as code: read it, then pass --trust_design_file or put its '
          'folder on PYTHONPATH')


def test_a_copied_runs_design_file_runs_only_with_the_users_word(shared_run, monkeypatch):
  run, marker = shared_run
  for read in (lambda: train_config.read_config(run),  # what sampling, evaluating and the harness read
               lambda: command_line.load(str(run)),  # --config=WORKDIR: a resume
               lambda: loader.lm_run_on_mesh(run).__enter__(),
               lambda: next(evaluate.evaluate_run(run, ['held_out']))):
    with pytest.raises(InputError) as refused:
      read()
    assert str(refused.value) == refusal(run)
  monkeypatch.syspath_prepend(str(run))  # `python -m ...` in the run's folder: its files are still the run's
  with pytest.raises(InputError, match='would run as code'):
    train_config.read_config(run)
  saved = json.loads((run / 'config.json').read_text())
  (run / 'config.json').write_text(json.dumps({**saved, 'design_file': str(run / 'gone.py')}))
  with pytest.raises(InputError) as refused:  # the recorded file gone: nor is the run's folder searched
    train_config.read_config(run)
  assert str(refused.value) == (f"model.stream.design='{DESIGN}': shared_gated is not on your Python path (outside "
                                f"the run's folder), nor is the file the run recorded, {run / 'gone.py'}: put the "
                                'folder holding shared_gated.py on PYTHONPATH')
  (run / 'config.json').write_text(json.dumps(saved))
  with train_config.design_policy(imports=False):  # --print_config: the saved config as it is, nothing imported
    config = command_line.load(str(run))
  assert train_config.unimported_design(config) == DESIGN and config.model.shared_gate.gate == 'scalar'
  assert not marker.exists() and 'shared_gated' not in sys.modules and 'shared_gate' not in designs.REGISTRY


def test_a_trusted_design_file_is_imported_while_its_hash_is_the_recorded_one(shared_run, capsys):
  run, marker = shared_run
  with train_config.design_policy(trust=True):
    config = train_config.read_config(run)
  assert config.model.stream.design == 'shared_gate' and marker.read_text() == 'ran'
  assert capsys.readouterr().err == (f"notice: model.stream.design='{DESIGN}': imported shared_gated from "
                                     f'{run / "shared_gated.py"}, the file the run recorded (--trust_design_file)\n')
  designs.REGISTRY.pop('shared_gate')  # as a later command
  sys.modules.pop('shared_gated')
  marker.unlink()
  with (run / 'shared_gated.py').open('a') as f:
    f.write('# changed after the run recorded it\n')
  with train_config.design_policy(trust=True), pytest.raises(InputError) as refused:
    train_config.read_config(run)
  assert str(refused.value).startswith(f"model.stream.design='{DESIGN}': shared_gated is not on your Python path, "
                                       f'and the run names its file {run / "shared_gated.py"}, changed since the run '
                                       'recorded it (sha256 ')
  assert str(refused.value).endswith('...): not imported; read it, and if it is the design you mean, put its folder '
                                     'on PYTHONPATH')
  assert not marker.exists()


@pytest.fixture
def run_naming_paths(tmp_path):
  """(run, its data.path, its data.vocab_path): a run whose config.json names a corpus and a vocabulary elsewhere,
  the vocabulary no SentencePiece model."""
  vocab, shards = tmp_path / 'elsewhere' / 'vocab.model', tmp_path / 'elsewhere' / 'shards'
  vocab.parent.mkdir()
  vocab.write_bytes(b'not a SentencePiece model')
  config = load_config('configs/c4_ablation.py:rw_lr,preset=tiny', {
      **TINY_LM, 'data.name': 'corpus', 'data.path': str(shards), 'data.vocab_path': str(vocab)})
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'config.json').write_text(train_config.as_json(train_config.build_config(config)))
  return run, shards, vocab


def test_the_paths_a_run_names_are_shown_before_they_are_read(run_naming_paths, capsys):
  """Sampling and scoring read the run's vocabulary (and its data, for held_out) where its config.json says: the line
  comes first, then the one-line refusal of an unreadable vocabulary, before anything compiles."""
  run, shards, vocab = run_naming_paths
  with pytest.raises(InputError, match=r"^data\.vocab_path='.+': cannot read a SentencePiece model"):
    loader.lm_run_on_mesh(run).__enter__()
  assert capsys.readouterr().err == (f"reading what {run / 'config.json'} names: data.path={str(shards)!r}, "
                                     f'data.vocab_path={str(vocab)!r}\n')
  typed = train_config.read_config(run)
  assert train_config.named_paths(typed, overridden={'data.path': 'mine'}) == {'data.vocab_path': str(vocab)}
  assert train_config.run_of(str(run)) == command_line.resolve_spec(str(run)) == str(run)  # --config=WORKDIR
  assert train_config.run_of('c4_ablation:rw_lr') is None


@pytest.mark.slow
def test_resuming_a_run_shows_the_paths_it_names_before_reading_them(run_naming_paths, tmp_path):
  run, _, vocab = run_naming_paths
  status, _, err = call_main(main.main, f'--config={run}', f'--workdir={run}',
                             f'--config.data.path={tmp_path / "mine"}')
  shown, refused = err.splitlines()  # the user's own data.path is not the run's say
  assert (status, shown) == (2, f"reading what {run / 'config.json'} names: data.vocab_path={str(vocab)!r}")
  assert refused.startswith(f"error: data.vocab_path='{vocab}': cannot read a SentencePiece model")


@pytest.mark.slow
def test_generate_evaluate_resume_and_print_config_run_nothing_a_copied_run_names(shared_run, monkeypatch):
  run, marker = shared_run
  commands = {'generate': (generate.main, f'--workdir={run}', '--prompt=x'),
              'evaluate': (evaluate.main, f'--workdir={run}', '--task=held_out'),
              'resume': (main.main, f'--config={run}', f'--workdir={run}'),
              'print_config': (main.main, f'--config={run}', '--print_config')}
  monkeypatch.chdir(run)  # from the run's own folder, which `python -m` puts first on the path
  monkeypatch.syspath_prepend(str(run))
  for name, (command, *args) in commands.items():
    status, out, err = call_main(command, *args)
    if name == 'print_config':
      assert status == 0, err
      assert json.loads(out)['model']['stream']['design'] == DESIGN
      assert err == (f"notice: model.stream.design='{DESIGN}' is not imported (--print_config runs no code a run "
                     'names): the config as the run saved it, its design unchecked\n')
    else:
      assert (status, err) == (2, f'error: {refusal(run)}\n'), name
    assert not marker.exists(), name
