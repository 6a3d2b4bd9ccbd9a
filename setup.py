"""The C extension of the control path (synkhronos/runtime/_block.c); the rest is in pyproject.toml.

Every install compiles it, ``pip install -e .`` included (gcc and the Python
headers).  ``-ffp-contract=off``: the small reductions must give the bits
NumPy's would, so no fused multiply-adds.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("synkhronos.runtime._block", ["synkhronos/runtime/_block.c"],
                             extra_compile_args=["-O2", "-std=gnu11", "-ffp-contract=off"])])
