"""Errors that cross process boundaries whole.

Ray sends an exception raised in an actor to its caller by pickling it, and pickle rebuilds an exception as
`cls(*args)`, where `args` is the message only. An error whose constructor takes more than its message therefore
failed to unpickle: the caller got Ray's `UnserializableException` instead, without the type an `except` clause
matches or the fields the driver reads (`WeightSyncError.stuck_urls`: which engines to restart).
"""

from __future__ import annotations


class StructuredError(RuntimeError):
    """A RuntimeError with fields besides its message, rebuilt after pickling with its message and fields as
    raised (no second run of its constructor, which may format the message from the fields)."""

    def __reduce__(self):
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type, args: tuple, fields: dict) -> StructuredError:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, *args)
    error.__dict__.update(fields)
    return error
