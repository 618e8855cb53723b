"""flash-attn's error convention: its extension refuses bad arguments with ``RuntimeError`` (``TORCH_CHECK``), so
the dialect's entry points raise attnops' argument errors as classes that are also ``RuntimeError``s."""
from __future__ import annotations

import functools

from .._core.errors import AclnnError

_CLASSES: dict[type, type] = {}


class FlashAttnArgumentError(RuntimeError):
    """Base of the errors :func:`flash_attn_errors` raises: each also derives from the attnops error it stands for
    (``ParamInvalidError``, ``ParamDtypeError``, ...), with the same message and ``status``."""


def as_runtime_error(error: AclnnError) -> AclnnError:
    """``error`` re-typed as a subclass of both its own class and :class:`FlashAttnArgumentError`."""
    if isinstance(error, RuntimeError):
        return error
    cls = type(error)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls, FlashAttnArgumentError),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                              "__doc__": f"{cls.__doc__ or cls.__name__} Also a RuntimeError (flash-attn's)."})
    translated = _CLASSES[cls](*error.args)
    translated.__dict__.update(error.__dict__)
    translated.status = error.status
    return translated


def flash_attn_errors(function):
    """Decorator for an entry point of the dialect: attnops argument errors leave it as :func:`as_runtime_error`."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except AclnnError as error:
            if isinstance(error, RuntimeError):
                raise
            raise as_runtime_error(error).with_traceback(error.__traceback__) from None
    return wrapper
