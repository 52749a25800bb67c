"""The house's one rule, read from the import graph of laurel/ (every import, lazy ones included): the research core
at the top, laurel.run (what runs a job), laurel.plan (what a step would cost on a slice), laurel.serve (what
uses a trained run) and laurel.prepare (what prepares a corpus) as its wings, and laurel.cli, what every command
shares (its console, process and files), beneath them all."""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'laurel'
DESIGNS_MAY_IMPORT = ('laurel.designs', 'laurel.config_lib', 'laurel.sharding')
CORE_WITH_A_DOOR_TO_THE_WINGS = ('laurel.train', 'laurel.main', 'laurel.command_line')  # the loop and the entry point


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob('*.py'))}


def imports(path: pathlib.Path) -> set[str]:
  """The laurel modules a file imports anywhere in it (`from laurel import x` is laurel.x where that is a module)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith('laurel')}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or '').startswith('laurel'):
      found |= {f'{node.module}.{a.name}' if f'{node.module}.{a.name}' in MODULES else node.module for a in node.names}
  return found


def in_wing(module: str, wing: str) -> bool:
  return module == f'laurel.{wing}' or module.startswith(f'laurel.{wing}.')


def core(module: str) -> bool:
  return not any(in_wing(module, wing) for wing in ('run', 'plan', 'serve', 'prepare', 'cli'))


def test_the_graph_is_read():  # the rules below hold for a reason, not because nothing was found
  assert {'laurel.train', 'laurel.designs.laurel', 'laurel.run.checkpoint', 'laurel.serve.generate',
          'laurel.prepare.text'} <= set(MODULES)
  assert 'laurel.run.checkpoint' in imports(MODULES['laurel.train'])
  assert 'laurel.designs.protocol' in imports(MODULES['laurel.designs.laurel'])
  assert 'laurel.prepare.shards' in imports(MODULES['laurel.prepare.text'])


@pytest.mark.parametrize('module', [m for m in MODULES if m.startswith('laurel.designs')])
def test_a_design_imports_only_designs_the_config_and_sharding(module):
  outside = {m for m in imports(MODULES[module]) if not m.startswith(DESIGNS_MAY_IMPORT)}
  assert not outside, f'{module} imports {sorted(outside)}'


@pytest.mark.parametrize('module', [m for m in MODULES if core(m) and m not in CORE_WITH_A_DOOR_TO_THE_WINGS])
def test_of_the_core_only_the_loop_and_the_entry_point_import_the_wings(module):
  wings = {m for m in imports(MODULES[module]) if not core(m)}
  assert not wings, f'{module} imports {sorted(wings)}'


@pytest.mark.parametrize('module', [m for m in MODULES if not in_wing(m, 'serve')])
def test_nothing_in_the_core_or_the_other_wings_imports_the_serve_wing(module):
  serve = {m for m in imports(MODULES[module]) if in_wing(m, 'serve')}
  assert not serve, f'{module} imports {sorted(serve)}'


@pytest.mark.parametrize('module', [m for m in MODULES if not in_wing(m, 'prepare')])
def test_nothing_outside_the_prepare_wing_imports_it(module):
  prepare = {m for m in imports(MODULES[module]) if in_wing(m, 'prepare')}
  assert not prepare, f'{module} imports {sorted(prepare)}'


@pytest.mark.parametrize('module', [m for m in MODULES if in_wing(m, 'cli')])
def test_what_every_command_shares_imports_no_wing_and_of_the_core_only_the_config(module):
  above = {m for m in imports(MODULES[module]) if m.startswith('laurel') and not in_wing(m, 'cli')}
  assert above <= {'laurel.config_lib'}, f'{module} imports {sorted(above)}'


def test_no_import_cycle():  # lazy imports included: one inside a function only hides a cycle
  graph = {m: {i for i in imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
  for package in [m for m, p in MODULES.items() if p.name == '__init__.py']:  # a package's modules load it first
    for member in MODULES:
      if member.startswith(package + '.'):
        graph[member].discard(package)
  cycles, state = [], {}

  def visit(module, path):
    state[module] = 'open'
    for imported in sorted(graph[module]):
      if state.get(imported) == 'open':
        cycles.append(path[path.index(imported):] + [imported])
      elif imported not in state:
        visit(imported, path + [imported])
    state[module] = 'done'

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])
  assert not cycles, ' ; '.join(' -> '.join(c) for c in cycles)


def test_threads_start_only_through_the_process_module_under_a_name_of_its_table():
  from laurel.cli import process  # pylint: disable=import-outside-toplevel
  started_elsewhere = [name for name, path in MODULES.items() if name != 'laurel.cli.process'
                       and 'threading.Thread(' in path.read_text()]
  assert not started_elsewhere
  assert len(process.THREADS) <= 3  # a reader holds them in mind
  for name in process.THREADS:
    assert f'| {name} ' in process.__doc__, name
  with pytest.raises(ValueError, match='not a thread of laurel.cli.process.THREADS'):
    process.start_thread('laurel-unknown', lambda: None)


def test_every_exit_status_is_in_the_process_table_and_in_laurel_mains_help():
  from laurel.cli import process  # pylint: disable=import-outside-toplevel
  statuses = {v for k, v in vars(process).items() if k.isupper() and isinstance(v, int) and 0 <= v < 256}
  assert statuses == set(process.EXIT_STATUSES) and len(statuses) <= 6
  help_text = ast.get_docstring(ast.parse(MODULES['laurel.main'].read_text()))  # not imported: it defines flags
  for status in process.EXIT_STATUSES:
    assert re.search(rf'^  {status} +\S', help_text, re.M), status
