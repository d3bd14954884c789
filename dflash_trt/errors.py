"""The few domain errors the library raises; `cli.py` turns them into exit codes once."""


class DFlashError(Exception):
    """Base class: a user-correctable problem with a clear message."""


class ConfigError(DFlashError):
    """A config.json, preset or option has a missing, unknown or bad value."""


class CheckpointError(DFlashError):
    """A weight file is missing, corrupt, or lacks a tensor the model needs."""


class PairError(DFlashError):
    """A target and a drafter that cannot work together."""


class RequestError(DFlashError):
    """A generation request that the engine cannot serve (bad length, bad sampling value)."""


class BuildError(DFlashError):
    """A build that cannot proceed (missing source, existing output, failed step)."""


class ServeError(DFlashError):
    """tritonserver cannot be found, prepared, started or kept running."""
