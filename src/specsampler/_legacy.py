"""The module paths of the flat layout (before the subpackages), kept importable.

``import specsampler.chain`` (and the others below) gives the very module object that now lives at
its new path, so attributes, monkeypatches and ``isinstance`` checks see one module, not a copy.
``python -m specsampler.modelpair`` still runs the training script.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

MOVED = {
    "specsampler.processing": "specsampler.sampling.processing",
    "specsampler.chain": "specsampler.verify.chain",
    "specsampler.tree": "specsampler.verify.token_tree",
    "specsampler.treeverify": "specsampler.verify.tree",
    "specsampler.kv": "specsampler.verify.kv",
    "specsampler.oracle": "specsampler.verify.oracle",
    "specsampler.exactness": "specsampler.verify.exactness",
    "specsampler.modelpair": "specsampler.generate.modelpair",
    "specsampler.demo": "specsampler.cli.demo",
    "specsampler.bench": "specsampler.cli.bench",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        # The module was executed under its new name; importing it again here would run it twice.
        pass

    def get_code(self, fullname):
        # ``python -m <old path>``: run the new module as __main__.
        return compile(f"import runpy; runpy.run_module({MOVED[fullname]!r}, run_name='__main__', alter_sys=True)",
                       f"<{fullname}>", "exec")


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
