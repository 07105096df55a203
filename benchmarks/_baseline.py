"""Another revision's kernel module (``git show REV:path > FILE``), loaded beside the current one for a same-run A/B."""

import importlib.util
import sys
from types import ModuleType


def load_beside(path, package: str, name: str) -> ModuleType:
    """The file ``path`` as module ``package.name``, so its relative imports resolve to the current package (Triton
    reads a kernel's source from that file)."""
    spec = importlib.util.spec_from_file_location(f"{package}.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
