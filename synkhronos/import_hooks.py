"""Registrations with a module that must wait until something else imports it.

PyTensor's JAX dispatch module imports jax, which a CPU user need not pay
for; the JAX implementations of our Ops and PyMC's
``erfcx`` are registered with it only once it loads (``when_imported``).
"""

import importlib.abc
import importlib.util
import sys


def when_imported(name, fn):
    """Run ``fn()`` once module ``name`` is imported: now if it is, else right after it
    loads (an import hook, which then leaves ``sys.meta_path``).  For registrations with
    a backend's dispatch module that must not import it themselves."""
    if name in sys.modules:
        fn()
        return
    hook = next((f for f in sys.meta_path if isinstance(f, _ImportHook) and f.name == name), None)
    if hook is None:
        hook = _ImportHook(name)
        sys.meta_path.insert(0, hook)
    if fn not in hook.callbacks:
        hook.callbacks.append(fn)


class _AfterLoad(importlib.abc.Loader):
    """Run a module's own loader, then the callbacks waiting for it."""

    def __init__(self, loader, callbacks):
        self.loader, self.callbacks = loader, callbacks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        for fn in self.callbacks:
            fn()


class _ImportHook(importlib.abc.MetaPathFinder):
    """Find module ``name`` as usual, wrapping its loader; once."""

    def __init__(self, name):
        self.name, self.callbacks = name, []

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterLoad(spec.loader, self.callbacks)
        return spec
