"""torchrun's error file, written whole or not at all.

Under torchrun each rank's top-level function is wrapped in elastic's ``@record``, which writes the rank's
traceback as JSON to ``TORCHELASTIC_ERROR_FILE`` so the agent can name the root cause. torch writes it in place
(``ErrorHandler.record_exception``: ``open(file, "w")`` then ``json.dump``). When one rank fails, the agent
terminates the others (``SubprocessContext._poll``: ``close()``) and then reads every failed rank's error file
(``_capture_process_failures`` -> ``ProcessFailure.__post_init__``: ``json.load``). A rank that was writing its
own error file (a peer's failure reached it in a collective) when SIGTERM came leaves an empty or cut file, and
the agent itself dies of a JSONDecodeError instead of restarting the workers. Here the file appears by rename.
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

F = TypeVar("F", bound=Callable)
_ENV = "TORCHELASTIC_ERROR_FILE"


class AtomicErrorHandler(ErrorHandler):
    """torch's error handler, writing its JSON beside the error file and renaming it into place."""

    def record_exception(self, e: BaseException) -> None:
        try:
            str(e)
        except Exception:  # noqa: BLE001 - torch formats f"{type(e).__name__}: {e}", which would raise here
            e = _stand_in(e)
        file = os.environ.get(_ENV)
        if not file:
            return super().record_exception(e)  # no file: torch logs what it would have written
        partial = f"{file}.{os.getpid()}.partial"
        os.environ[_ENV] = partial  # torch's own format, written to the side
        try:
            super().record_exception(e)
        finally:
            os.environ[_ENV] = file
        os.replace(partial, file)  # atomic: the agent reads nothing or all of it


def _stand_in(e: BaseException) -> BaseException:
    """An error of the same type name whose str() is what of `e` can be rendered (report.error_text)."""
    from .report import error_text

    name = type(e).__name__
    return type(name, (Exception,), {})(error_text(e)[len(name) + 2:])


def record_atomically(fn: F) -> F:
    """elastic's ``@record`` with an error file that is never seen half-written."""
    return record(fn, error_handler=AtomicErrorHandler())
