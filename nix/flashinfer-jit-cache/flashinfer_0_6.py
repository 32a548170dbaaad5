"""@description@

The flashinfer_jit_cache interface of FlashInfer 0.6 (read from flashinfer-python 0.6.18's
flashinfer/jit/env.py): `__version__` starts with FlashInfer's own version, and
get_jit_cache_dir() holds <module>/<module>.so.
"""

import os

__version__ = "@version@"


def get_jit_cache_dir():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "jit_cache")
