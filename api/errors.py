"""Errors raised by :mod:`overtake.api` (the REST API and the ``overtake`` command line).

Hierarchy::

    OvertakeError (overtake.errors)
    └── ApiError
        ├── HTTPError                       an answer other than 2xx: status, one-line detail, headers
        ├── ApiUsageError (ValueError)      an ``overtake api`` option is unusable; names the flag
        │   └── DatabaseURLError            --db is neither a SQLite path nor a sqlite:///PATH URL
        ├── QueueFullError                  ``--max-queued`` jobs already wait (answered 429)
        ├── WorkerDiedError                 a worker process ended without answering its call
        └── WorkerTimeoutError              a worker process did not answer its call in time

The other sub-commands' usage errors sit under their package's root, so that the library's
handlers answer them alike: :class:`FitUsageError` (``overtake fit``) is a
:class:`~overtake.fitting.errors.FittingInputError`, :class:`DiagnoseUsageError` (``overtake
diagnose``) a :class:`~overtake.controller.errors.ControllerError`.

Scenario errors stay :class:`overtake.mdp.errors.ModelError` (the schema is the solver's), fit
errors :class:`overtake.fitting.errors.FittingInputError`; the API answers both with 422. Every
4xx body is ``{"detail": "<field>: <what is wrong and the fix>"}``.
"""

from __future__ import annotations

from overtake.controller.errors import ControllerError
from overtake.errors import OvertakeError
from overtake.fitting.errors import FittingInputError

__all__ = ["ApiError", "ApiUsageError", "DatabaseURLError", "DiagnoseUsageError", "FitUsageError", "HTTPError",
           "QueueFullError", "WorkerDiedError", "WorkerTimeoutError"]


class ApiError(OvertakeError):
    """Root of the API package's errors."""


class HTTPError(ApiError):
    """An answer other than 2xx with a one-line ``detail`` naming the field and the fix.

    Parameters
    ----------
    status
        The HTTP status code (4xx, or 500 for a stored artifact that cannot be read).
    detail
        ``"<field>: <what is wrong and the fix>"``, the body's only key.
    headers
        Extra response headers (``WWW-Authenticate`` on 401, ``Retry-After`` on 429).
    """

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers

    def __reduce__(self) -> tuple[type[HTTPError], tuple[int, str, dict[str, str] | None]]:
        # raised in the parse process (overtake.api.offload.ParseProcess): crosses back by pickle
        return HTTPError, (self.status, self.detail, self.headers)


class ApiUsageError(ApiError, ValueError):
    """An ``overtake api`` option is unusable; the message names the flag and the rule."""


class DatabaseURLError(ApiUsageError):
    """The ``--db`` value is not a SQLite path or URL."""


class QueueFullError(ApiError):
    """``max_queued`` jobs already wait; ``queued`` is their number."""

    def __init__(self, queued: int) -> None:
        super().__init__(f"{queued} jobs are queued")
        self.queued = queued


class WorkerDiedError(ApiError):
    """A worker process ended without answering; the message says how (exit code or signal)."""


class WorkerTimeoutError(ApiError):
    """A worker process did not answer within the call's timeout (it still runs the call)."""


class FitUsageError(FittingInputError):
    """A command-line option of ``overtake fit`` is unusable."""


class DiagnoseUsageError(ControllerError, ValueError):
    """A command-line option or the input of ``overtake diagnose`` is unusable."""
