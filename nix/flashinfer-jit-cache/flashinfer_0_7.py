"""@description@

The flashinfer_jit_cache interface of FlashInfer 0.7 (read from flashinfer-python 0.7.2.post1's
flashinfer/jit/env.py): at import, FlashInfer calls get_jit_cache_providers() and takes from
each provider its distribution, version (equal to this module's `__version__`, which starts with
FlashInfer's own version and a `+`), jit_cache_dir (holding <module>/<module>.so), the CUDA
architectures the kernels were built for (`sm121a`, as FlashInfer's CompilationContext names
its targets; written at build time to cuda_architectures.json) and the module names.
"""

import json
import os
from typing import NamedTuple

__version__ = "@version@"

_HERE = os.path.dirname(os.path.abspath(__file__))


class JitCacheProvider(NamedTuple):
    provider_id: str
    distribution: str
    version: str
    jit_cache_dir: str
    cuda_architectures: frozenset
    modules: frozenset


def get_jit_cache_dir():
    return os.path.join(_HERE, "jit_cache")


def get_jit_cache_providers():
    jit_cache_dir = get_jit_cache_dir()
    with open(os.path.join(_HERE, "cuda_architectures.json")) as file:
        architectures = json.load(file)
    modules = [
        name
        for name in sorted(os.listdir(jit_cache_dir))
        if os.path.isfile(os.path.join(jit_cache_dir, name, f"{name}.so"))
    ]
    return [
        JitCacheProvider(
            provider_id="@distribution@",
            distribution="@distribution@",
            version=__version__,
            jit_cache_dir=jit_cache_dir,
            cuda_architectures=frozenset(architectures),
            modules=frozenset(modules),
        )
    ]
