"""A command that the docs or a run print, run as a shell runs it, its laurel command line in this process."""
import contextlib
import importlib
import os
import shlex
import subprocess
import sys
import traceback

from helpers import call_main, on_devices

# The command lines with a `main(argv)` (docs/testing.md "In process"); any other program runs in bash.
IN_PROCESS = ('laurel.main', 'laurel.serve.generate', 'laurel.serve.evaluate', 'laurel.prepare.c4',
              'laurel.prepare.text')


def run_as_printed(command: str, cwd, env: dict) -> subprocess.CompletedProcess:
  """`command` as `bash -c` in `cwd` with `env` runs it. Where it is one command `PYTHON -m laurel...` whose program
  is this interpreter as that shell finds it, its words as bash splits them (quotes, a path with a space, a glob, a
  trailing comment) go to the module's main(argv) in this process, in `cwd`, a training run on one device: no process
  of its own to start."""
  lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
  lexer.whitespace_split = True
  if not any(set(word) <= set(lexer.punctuation_chars) for word in lexer):  # no pipe, list or redirection
    parsed = subprocess.run(['bash', '-c', f'set -- {command}\nprintf "%s\\0" "$(type -P "$1")" "$@"'], cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=60, check=True)
    found, *words = parsed.stdout.split('\0')[:-1]
    this = found and os.path.normpath(os.path.join(cwd, found)) == os.path.normpath(sys.executable)
    if this and len(words) > 2 and words[1] == '-m' and words[2] in IN_PROCESS:
      with contextlib.chdir(cwd), on_devices(1):  # a training run: the one device of its own process (cli_env)
        try:
          status, out, err = call_main(importlib.import_module(words[2]).main, *words[3:])
        except Exception:  # pylint: disable=broad-except  # a traceback, as the process would end with
          status, out, err = 1, '', traceback.format_exc()
      return subprocess.CompletedProcess(words, status, out, err)
  return subprocess.run(['bash', '-c', command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
