"""dflash-trt: lossless DFlash speculative decoding for Qwen targets.

The public API is small and exported lazily so that `import dflash_trt` (and the CLI's
`--help`) does not import torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_pair": "dflash_trt.loading",
    "Engine": "dflash_trt.engine",
    "SamplingParams": "dflash_trt.sampling",
    "GenerationResult": "dflash_trt.engine",
    "RequestStats": "dflash_trt.engine",
    "TargetConfig": "dflash_trt.config",
    "DraftConfig": "dflash_trt.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash_trt' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
