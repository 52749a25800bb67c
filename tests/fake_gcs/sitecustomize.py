"""A stand-in for Google Cloud Storage in the tests' subprocesses: with this folder on PYTHONPATH and
FAKE_GCS_ROOT=<dir> set, gs://BUCKET/PATH is the local file <dir>/BUCKET/PATH for etils.epath (set EPATH_USE_TF=0,
so that epath goes through fsspec). Appends are refused, as GCS has none. Python imports `sitecustomize` at
startup."""
import os

if os.environ.get('FAKE_GCS_ROOT'):
  import fsspec
  from fsspec.implementations import dirfs, local

  class FakeGCS(dirfs.DirFileSystem):
    protocol = ('gs', 'gcs')

    def __init__(self, *args, **kwargs):  # gcsfs's options (e.g. finalize_on_close) do not apply
      del args, kwargs
      super().__init__(path=os.environ['FAKE_GCS_ROOT'], fs=local.LocalFileSystem())

    def open(self, path, mode='rb', *args, **kwargs):  # GCS objects are written whole; gcsfs overwrites on 'a'
      if 'a' in mode:
        raise NotImplementedError(f'fake GCS: cannot append to {path} (GCS objects are written whole)')
      return super().open(path, mode, *args, **kwargs)

    def _join(self, path):
      if isinstance(path, str):
        return super()._join(path.removeprefix('gs://'))
      return [self._join(p) for p in path]

  fsspec.register_implementation('gs', FakeGCS, clobber=True)
  fsspec.register_implementation('gcs', FakeGCS, clobber=True)
