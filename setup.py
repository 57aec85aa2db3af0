# The CPU kernels are C, compiled once at install time through cffi (no compiler at run time).
# The extensions use CPython's stable ABI, so one wheel serves Python 3.10 and later.
from setuptools import setup

setup(cffi_modules=["ember/backends/cpu/_build.py:ffibuilder",
                    "ember/gbnf/_build.py:ffibuilder",
                    "ember/backends/webgpu/_build.py:ffibuilder"],
      options={"bdist_wheel": {"py_limited_api": "cp310"}})
