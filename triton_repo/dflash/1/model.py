"""Triton adapter for the engine; the logic, the drain and the watchdog included, is
dflash_trt.serving.dflash_model.DFlashModel."""

import triton_python_backend_utils as pb_utils

from dflash_trt.serving.dflash_model import DFlashModel


class TritonPythonModel(DFlashModel):
    def __init__(self):
        super().__init__(pb_utils)
