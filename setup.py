"""The C extensions (the rest is in pyproject.toml): each beside the Python that owns it.

- ``synkhronos.runtime._block`` (runtime/_block.c): the control path's bounded waits and
  wake-ups on int64 slots in shared memory.
- ``synkhronos.comm._reduce`` (comm/_reduce.c): the small reductions over comm/slabs.py's
  layout, which wait through _block (a capsule; runtime/_block.h declares it).

Every install compiles both, ``pip install -e .`` included (gcc and the Python headers).
``-ffp-contract=off``: the small reductions must give the bits NumPy's would, so no fused
multiply-adds.  ``depends``: a change to a header rebuilds each extension that includes it.
"""

from setuptools import Extension, setup

HEADERS = ["synkhronos/_c/atomics.h", "synkhronos/runtime/_block.h"]
FLAGS = ["-O2", "-std=gnu11", "-ffp-contract=off"]

setup(ext_modules=[
    Extension("synkhronos.runtime._block", ["synkhronos/runtime/_block.c"], depends=HEADERS,
              extra_compile_args=FLAGS),
    Extension("synkhronos.comm._reduce", ["synkhronos/comm/_reduce.c"], depends=HEADERS,
              extra_compile_args=FLAGS),
])
