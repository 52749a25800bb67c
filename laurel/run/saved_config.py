"""The config a run saved: `--config=WORKDIR` (or WORKDIR/config.json) resolves to this file with the run as its
argument (config_lib.resolve_spec), so that a run resumes as it was trained in one command."""
from laurel.run import checkpoint


def get_config(run: str):
  return checkpoint.read_config(run).lock()
