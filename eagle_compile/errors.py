"""Exceptions raised by eagle_compile. Each message names the problem, the value seen and the fix."""


class EagleError(Exception):
    """Base class of every error raised on purpose by eagle_compile."""


class OptionsError(EagleError, ValueError):
    """An option key or value that the backend does not accept."""


class UnsupportedModelError(EagleError):
    """A target whose captured graph the passes cannot rewrite (for example no recognisable decoder layers)."""


class CheckpointError(EagleError, ValueError):
    """A draft checkpoint that cannot be loaded as it is (bad layout, shapes or vocabulary mapping)."""


class UnsupportedGenerationError(EagleError, ValueError):
    """A generation setting speculative decoding cannot honour losslessly."""


class ExportError(EagleError, ValueError):
    """A head or program that cannot be exported to the asked format without changing what it computes."""
