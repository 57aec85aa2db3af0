# The CPU kernels are C, compiled once at install time through cffi (no compiler at run time).
from setuptools import setup

setup(cffi_modules=["ember/backends/cpu/_build.py:ffibuilder",
                    "ember/gbnf/_build.py:ffibuilder"])
