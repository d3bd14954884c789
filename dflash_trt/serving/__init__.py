"""Serving with Triton: the request protocol, the engine worker behind the `dflash` model, the
model repository renderer, the tritonserver launcher and the client."""
