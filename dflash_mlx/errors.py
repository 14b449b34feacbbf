"""The package's errors: every one a user can fix derives from ``DFlashError``.

The CLIs print such an error as one ``error: ...`` line (see ``cli.run``);
anything else is a bug and keeps its traceback. Each class also derives from
the built-in exception callers already expect (``ValueError``, and
``FileNotFoundError`` for a checkpoint that is not there).
"""

from typing import Optional


class DFlashError(Exception):
    """An error the user can fix; its message says what is wrong and how."""


class CheckpointError(DFlashError, ValueError):
    """A model or drafter checkpoint that cannot be used as it is."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path or Hugging Face id."""


class ArgumentError(DFlashError, ValueError):
    """An argument value outside what the command or function accepts."""


class RequestError(DFlashError, ValueError):
    """A bad server request: answered with a 4xx error in the request's API dialect."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status
