"""The one error class users see: a clear line, an optional hint, exit code 1."""


class MetraleError(Exception):
    """A user-facing failure (bad input, missing file, unsupported option, exhausted pool).

    The CLI prints ``error: <message>`` and, when given, ``hint: <hint>`` and exits 1;
    ``--debug`` shows the traceback instead.
    """

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
