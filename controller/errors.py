"""Errors raised by :mod:`overtake.controller`.

::

    OvertakeError (overtake.errors)
    └── ControllerError
        └── ApacheError                     anything about the private Apache (controller.harness.apache)
            ├── ApacheNotInstalledError     apache2, mod_lua, gcc or the Lua 5.3 headers missing
            ├── ApacheInputError(ValueError) a bad argument: listen, cpu, max_workers, workdir, ...
            │   └── PortInUseError          the listen address is already bound by someone else
            ├── ApacheStartError            config test, launch or readiness wait failed
            ├── ApacheNotRunningError       status asked of an instance that does not answer
            └── ApacheStopTimeoutError      the PID was still alive when the stop timeout ran out
        └── SidecarInputError(ValueError)   bad sidecar input: stages file, policy spec, listen
            └── PolicyLoadError             a policy that cannot be used (corrupt, mismatched);
                                            a hot swap raising it keeps the old policy

Messages name the field, the value and the fix, e.g.
``listen: port 8081 on 127.0.0.1 is already in use; choose another port or stop its owner``.
Input errors also subclass :class:`ValueError`, so the CLI reports them as usage errors.
"""

from __future__ import annotations

from overtake.errors import OvertakeError

__all__ = [
    "ApacheError",
    "ApacheInputError",
    "ApacheNotInstalledError",
    "ApacheNotRunningError",
    "ApacheStartError",
    "ApacheStopTimeoutError",
    "ControllerError",
    "OvertakeError",
    "PolicyLoadError",
    "PhpNotInstalledError",
    "PortInUseError",
    "SidecarInputError",
]


class ControllerError(OvertakeError):
    """Root of the errors raised by :mod:`overtake.controller`."""


class ApacheError(ControllerError):
    """A problem with the private Apache instance."""


class ApacheNotInstalledError(ApacheError):
    """A Debian package the private Apache needs is not installed."""


class ApacheInputError(ApacheError, ValueError):
    """An argument of :mod:`overtake.controller.harness.apache` is invalid."""


class PortInUseError(ApacheInputError):
    """The requested listen address is already bound."""


class ApacheStartError(ApacheError):
    """The config test, the launch or the readiness wait failed."""


class ApacheNotRunningError(ApacheError):
    """No Apache answers for the given work directory."""


class ApacheStopTimeoutError(ApacheError):
    """Apache's parent process did not exit within the stop timeout."""


class PhpNotInstalledError(ControllerError):
    """PHP-FPM or phpize, which the private PHP-FPM pool needs, is not installed."""


class SidecarInputError(ControllerError, ValueError):
    """An input of the sidecar (stages file, policy spec, address, option) is invalid."""


class PolicyLoadError(SidecarInputError):
    """A policy cannot be loaded or does not match the stages; the running policy is kept."""
