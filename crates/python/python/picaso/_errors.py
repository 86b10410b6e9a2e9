"""picaso's exceptions. Each derives from `picaso.Error` and from the built-in it means, so
`except ValueError` and `except picaso.Error` both catch a bad argument."""


class Error(Exception):
    """Base of every error picaso raises (messages as the CLI prints them)."""


class InvalidArgument(Error, ValueError):
    """A bad argument value: unknown method, bad token id, empty prompt, bad sampling option, ..."""


class NotFound(Error, FileNotFoundError):
    """A model, state, store or embedder file or folder that does not exist."""


class StateMismatch(Error, ValueError):
    """A state or store made by another model (fingerprints differ) or of the wrong shape."""


for _cls in (Error, InvalidArgument, NotFound, StateMismatch):
    _cls.__module__ = "picaso"  # shown as picaso.Error, not picaso._errors.Error
