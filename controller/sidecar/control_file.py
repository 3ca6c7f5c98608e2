"""The control file: the age thresholds of the sidecar's policy, for mod_overtake_prio to apply.

The thresholds a solve chooses for age priority (``overtake solve --cpu-priority age``, or an
online refit) change with the fitted service times. Apache's module maps this file
(``OvertakeControlFile``) and puts its thresholds in force at the next request start, instead
of its configured ``OvertakePrioLevels``: no config edit, no restart, no graceful. The sidecar
rewrites it whenever its policy changes (start-up, refit, ``PUT /-/policy``).

Layout (shared with the C module, ``apache-conf/mod_overtake_prio/oc_table.h``), little-endian:
a 64-byte head — magic ``OVTCTRL1``, a 32-bit generation (odd while this side writes: the
module's reader is a seqlock and never takes a half-written table), the stage count, the level
count (0: the policy chose no thresholds, the module's configured ones apply), reserved zeros,
and at offset 32 ``HMAC-SHA256(key, head[0:32] + rows)`` under the key in ``FILE.key``
(:func:`~overtake.controller.sidecar.gate_key.load_key`: the module uses only a file of its own key).
Then 1 + STAGES rows of 72 bytes: 32-bit flags (bit 0 reserved for a per-stage demotion
exemption; written 0 here), 32 reserved bits, and eight 64-bit thresholds in nanoseconds of
thread CPU (the first ``levels`` > 0 and increasing, the rest 0). Row 0 is the one the module
applies to every request (Apache does not know a request's stage); rows 1.. are per stage of
the stages file, in its order. The solve's age priority chooses one set of thresholds for all
stages (a server-wide setting), so row 0 is the first stage's. In module mode a stage section
follows the rows (head word 20 its version, word 24 its length; the MAC covers it): the blind
policy's count table (:mod:`overtake.controller.sidecar.count_table`), which the module enforces
on the requests of its ``OvertakeStage`` sections.

The file is written in place with ``pwrite`` (never through a mapping, so a file someone
truncates cannot fault this process) and keeps its inode: a restarted sidecar continues after
the generation it finds. Mode 0640, the key file's group (Apache's workers), as the gate file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

from overtake.controller.errors import SidecarInputError
from overtake.controller.sidecar.count_table import CountTable, from_policy
from overtake.controller.sidecar.gate import give_group, open_shared_file
from overtake.controller.sidecar.gate_key import key_path, load_key

__all__ = ["MAX_LEVELS", "MAX_STAGES", "ControlFile", "ControlPublisher", "age_thresholds", "encode", "no_demotion"]

log = logging.getLogger("overtake.sidecar")

MAGIC = b"OVTCTRL1"
HEAD = 64
MAX_LEVELS = 8  # OP_MAX_LEVELS in the C module
MAX_STAGES = 255  # OC_MAX_STAGES
ROW = 8 + 8 * MAX_LEVELS
THRESHOLD_MAX = 3600.0  # seconds: the module's bound (OP_THRESHOLD_MAX)
_GEN = 8  # offset of the generation word
SECTION_STAGES = 1  # head word 20: a stage section (count table) of version 1 follows the rows


def age_thresholds(policy: Any) -> tuple[tuple[float, ...], ...] | None:
    """The per-stage age thresholds (model units) of ``policy``: its own, for a policy set the
    chosen member's, else the first member's that has them (the age thresholds are common to
    all members solved from one fit); None when no policy carries them."""
    members = getattr(policy, "members", None)
    candidates = [policy] if members is None else [getattr(policy, "chosen", None), *members]
    for p in candidates:
        if p is None:
            continue
        th = ((getattr(p, "priority_predictions", None) or {}).get("age") or {}).get("thresholds")
        if not th:  # a refit's policy records them without the age priority's simulated prediction
            meta = getattr(getattr(p, "policy", None), "meta", None) or {}
            th = ((meta.get("cpu_priority") or {}).get("age") or {}).get("thresholds")
        if th and th[0] and all(v is not None for row in th for v in row):
            return tuple(tuple(float(v) for v in row) for row in th)
    return None


def no_demotion(levels: int) -> tuple[float, ...]:
    """``levels`` increasing thresholds (seconds) ending at :data:`THRESHOLD_MAX`, 1 ms apart:
    the module's largest, so that no request is demoted (Apache's default)."""
    return tuple(THRESHOLD_MAX - 1e-3 * (levels - 1 - k) for k in range(levels))


def _row_ns(row: Sequence[float], levels: int, what: str) -> list[int]:
    if len(row) != levels:
        raise ValueError(f"{what}: {len(row)} thresholds, the first stage has {levels}")
    ns = [round(v * 1e9) if math.isfinite(v) else 0 for v in row]
    for k, (v, n) in enumerate(zip(row, ns)):
        if not 0 < n <= THRESHOLD_MAX * 1e9 or (k and n <= ns[k - 1]):
            raise ValueError(f"{what}: threshold {v!r} s is not in (0, {THRESHOLD_MAX:g}] s and increasing")
    return ns + [0] * (MAX_LEVELS - levels)


def encode(key: bytes, generation: int, stages: int, rows: Sequence[Sequence[float]] | None,
           section: bytes | None = None) -> bytes:
    """The whole file for ``rows`` (seconds, one row per stage; None or empty: no thresholds),
    with the even ``generation``, and the stage section ``section`` (a count table,
    :meth:`~overtake.controller.sidecar.count_table.CountTable.encode`) when given.

    Raises
    ------
    ValueError
        More than :data:`MAX_STAGES` stages or :data:`MAX_LEVELS` levels, rows of unequal
        length, a row count other than ``stages``, or a threshold not in (0, 3600] s and
        increasing.
    """
    if generation % 2 or not 0 < generation < 2**32:
        raise ValueError(f"generation {generation}: must be even, in 2..2**32-2")
    if not 0 <= stages <= MAX_STAGES:
        raise ValueError(f"{stages} stages: the module takes at most {MAX_STAGES}")
    levels = len(rows[0]) if rows else 0
    if levels > MAX_LEVELS:
        raise ValueError(f"{levels} levels: the module takes at most {MAX_LEVELS}")
    if rows and len(rows) != stages:
        raise ValueError(f"{len(rows)} rows of thresholds for {stages} stages")
    table = [_row_ns(r, levels, f"stage {i}") for i, r in enumerate(rows)] if rows else [[0] * MAX_LEVELS] * stages
    body = b"".join(struct.pack("<II8q", 0, 0, *r) for r in [table[0] if table else [0] * MAX_LEVELS, *table])
    sec = section or b""
    head = MAGIC + struct.pack("<IIIIII", generation, stages, levels, SECTION_STAGES if sec else 0, len(sec), 0)
    mac = hmac.new(key, head + body + sec, hashlib.sha256).digest()
    return head + mac + body + sec


class ControlFile:
    """The sidecar's side of the control file at ``path`` (created 0640 if missing, reused if
    present); its key is ``path + ".key"``, created when missing as the gate's."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = fd = open_shared_file(path, "control_file", "OvertakeControlFile")
        try:
            key, gid = load_key(key_path(path), "control_file")
            give_group(fd, gid)
            head = os.pread(fd, HEAD, 0)
        except BaseException:
            os.close(fd)
            raise
        self._key = key
        #: the generation last written (a restarted sidecar continues after the file's)
        self.generation = struct.unpack_from("<I", head, _GEN)[0] & ~1 if head[:8] == MAGIC else 0

    def write(self, stages: int, rows: Sequence[Sequence[float]] | None, section: bytes | None = None) -> int:
        """Write ``rows`` (seconds of thread CPU per stage; None: no thresholds) as the next
        generation and return it. The module sees either the previous table or this one.

        Raises
        ------
        ValueError
            The table is not one the module takes (:func:`encode`).
        SidecarInputError
            The file cannot be written.
        """
        gen = self.generation + 2
        if gen >= 2**32:
            gen = 2
        data = encode(self._key, gen, stages, rows, section)
        try:
            os.pwrite(self._fd, struct.pack("<I", gen - 1), _GEN)  # odd: readers keep the old table
            if os.fstat(self._fd).st_size != len(data):
                os.ftruncate(self._fd, len(data))
            os.pwrite(self._fd, data[:_GEN] + struct.pack("<I", gen - 1) + data[_GEN + 4:], 0)
            os.pwrite(self._fd, data[_GEN:_GEN + 4], _GEN)  # even: the table is whole
        except OSError as exc:
            raise SidecarInputError(f"control_file: cannot write {self.path}: {exc.strerror}") from None
        self.generation = gen
        return gen

    def close(self) -> None:
        os.close(self._fd)


class ControlPublisher:
    """Writes the thresholds of each policy the sidecar puts in force (:meth:`publish`), in
    seconds of thread CPU (the policy's model units times the sidecar's time unit)."""

    def __init__(self, path: str, stages: int, *, stage_names: Sequence[str] | None = None) -> None:
        """``stage_names``: module mode; every policy is also written as its count table
        (:mod:`~overtake.controller.sidecar.count_table`) for the module's ``OvertakeStage`` names."""
        self.file = ControlFile(path)
        self.stages = stages
        self.stage_names = tuple(stage_names) if stage_names is not None else None
        #: the count table written last (module mode), None: none (the module holds nothing)
        self.table: CountTable | None = None
        #: the module's configured level count (its status page), None before it is read; set
        #: with :meth:`without_age`
        self.levels: Callable[[], int | None] | None = None
        self._last: tuple[Any, float, int | None] | None = None  # policy, time unit, levels written

    def without_age(self, levels: Callable[[], int | None]) -> None:
        """From now on write thresholds no request reaches, whatever the policy's: the sidecar
        starts requests low by their predicted size instead (``cpu_priority: class``), and age
        on top would demote the small requests that run long. The module takes only its
        configured level count (``levels``): until it is known, no thresholds are written."""
        self.levels = levels

    def publish(self, policy: Any, time_unit: float, *, quiet: bool = False) -> int | None:
        """Write ``policy``'s thresholds (none: the module's configured ones apply) as a new
        generation; returns it, None when the file could not be written (said in the log).
        ``quiet``: log the write at debug level (the verifier's switches between its windows)."""
        if self.levels is not None:
            n = self.levels()
            self._last = (policy, time_unit, n)
            rows = [list(no_demotion(n))] * self.stages if n else None
            return self._write(rows, policy, getattr(policy, "name", "?") + " (cpu_priority class: no age)",
                               time_unit, quiet)
        th = age_thresholds(policy)
        rows = None if th is None else [[v * time_unit for v in r] for r in th]
        return self._write(rows, policy, getattr(policy, "name", "?"), time_unit, quiet)

    def sync(self) -> int | None:
        """Rewrite the last policy when the module's level count has changed since it was written
        (:meth:`without_age`); None when nothing was written."""
        if self.levels is None or self._last is None or self.levels() == self._last[2]:
            return None
        return self.publish(self._last[0], self._last[1])

    def publish_off(self, levels: int | None, *, quiet: bool = False) -> int | None:
        """Write thresholds that demote nothing: ``levels`` thresholds (the module takes only its
        configured count) at its largest, 3600 s of thread CPU, that no request reaches. None or 0
        levels: no thresholds (the module's configured ones apply)."""
        rows = [list(no_demotion(levels))] * self.stages if levels else None
        return self._write(rows, None, "Apache's default", 1.0, quiet)  # no count table: nothing held

    def _write(self, rows: list[list[float]] | None, policy: Any, name: str, time_unit: float,
               quiet: bool) -> int | None:
        try:
            table = (from_policy(policy, self.stage_names)
                     if self.stage_names is not None and policy is not None else None)
            gen = self.file.write(self.stages, rows, table.encode() if table is not None else None)
            self.table = table
        except (ValueError, SidecarInputError) as exc:
            log.error(f"control_file: the thresholds of {name} were not written ({exc}); Apache keeps the "
                      "previous ones", extra={"event": "control_file_refused", "policy": name, "detail": str(exc)})
            return None
        said = (f"age thresholds {', '.join(f'{v:.4g}' for v in rows[0])} s of thread CPU" if rows
                else "no age thresholds (Apache's configured OvertakePrioLevels apply)")
        if self.stage_names is not None:
            said += (f", count table of {self.table.cells} observations (caps waiting {list(self.table.wcap)}, "
                     f"running {list(self.table.kcap)})" if self.table is not None
                     else ", no count table (the policy holds nothing)")
        log.log(logging.DEBUG if quiet else logging.INFO,
                f"control_file: {said} from {name}, generation {gen} in {self.file.path}",
                extra={"event": "control_file", "policy": name,
                       "detail": {"generation": gen, "thresholds_seconds": rows, "time_unit": time_unit}})
        return gen
