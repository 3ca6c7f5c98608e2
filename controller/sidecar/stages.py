"""The stages file: which requests belong to which stage, and the sidecar's limits.

A request is routed to the first stage with a route whose ``path`` regex matches the URL path
(``re.match``, query excluded; run in linear time by :class:`overtake.regex.LinearRegex`, which
refuses backreferences and lookaround), whose ``query`` regex, if given, is found in the query
string as sent (``re.search``; e.g. ``'(^|&)action=(submit|edit)(&|$)'``) and whose ``methods``
contain the request method; requests no stage claims are *passed through* (the model covers only
the policed stages) under their own optional concurrency cap.

A route's ``key`` says which requests are "the same" for learned classification (each key keeps
its own history of service demands): by default the method and path; a list of ``path``,
``query`` (the whole query string), ``param:NAME`` (one query parameter's value, e.g.
``param:title`` for ``/index.php?title=Page``), ``body_size`` (the request body's length in
half-octave bins: a wiki preview's cost grows with the text it renders) and ``link`` (the key of
the request this client sent at the previous stage, when that stage names this one as its
``next``: the two stages of one transaction cost alike; with ``link`` alone the sidecar predicts
the follow-up's phase when it reserves its thread). Example (``examples/sidecar/stages.yaml``)::

    stages:
      - name: stage1
        path: "^/stage1$"            # shorthand for routes: [{path: ...}]
        next: stage2                 # the client asks for stage2 next (tandem routing, limiter.py)
      - name: stage2
        routes:
          - {path: "^/stage2$", methods: [GET, POST]}
          - {path: "^/report/", phase: 2}   # a route rule that fixes the phase (explicit mode)
    passthrough: {cap: 32}
    limits: {max_inflight: 256, queue_cap: 1000, queue_timeout: 30}
    classifier: {mode: explicit, header: X-Overtake-Phase}

A stage's ``lock: m`` says its requests take a serialising resource (a database write lock):
at most m of them are in Apache at once, the others wait in the sidecar, the highest response
ratio (wait + predicted) / predicted first (:mod:`overtake.controller.sidecar.stage_lock`).
Under ``--cpu-priority class`` with a policy that knows no phases, ``class_threshold`` /
``class_quantile`` say which keyed requests start at mod_overtake_prio's low level by their
predicted size (:mod:`overtake.controller.sidecar.size_class`).

Validation is eager; every error is one line naming the field, the value and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from overtake.controller.errors import SidecarInputError
from overtake.regex import LinearRegex, check_pattern

__all__ = ["ClassifierSettings", "Limits", "Route", "StageSpec", "StagesConfig", "StageTable", "load_stages"]

_HTTP_METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_KEY_PARTS = ("path", "query", "body_size", "link")


class Route(_Strict):
    """One routing rule: path regex, query regex, methods, optionally the phase it implies
    (1-based), and the learned-classification key."""

    path: str
    query: str | None = None
    methods: tuple[str, ...] | None = None
    phase: int | None = Field(default=None, ge=1)
    key: tuple[str, ...] | None = None

    @field_validator("path")
    @classmethod
    def _regex(cls, v: str) -> str:
        return check_pattern(v)

    @field_validator("query")
    @classmethod
    def _query(cls, v: str | None) -> str | None:
        return None if v is None else check_pattern(v)

    @field_validator("key")
    @classmethod
    def _key(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("an empty key makes every request of the route alike; omit key for method and path")
        for part in v:
            name = part.removeprefix("param:")
            if part.startswith("param:") and not name:
                raise ValueError("param: needs the query parameter's name, e.g. param:title")
            if not part.startswith("param:") and part not in _KEY_PARTS:
                raise ValueError(f"unknown key part {part!r}; use {', '.join(_KEY_PARTS)} or param:NAME")
        if len(set(v)) != len(v):
            raise ValueError("a key part appears twice")
        return v

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        out = tuple(m.upper() for m in v)
        bad = [m for m in out if m not in _HTTP_METHODS]
        if bad:
            raise ValueError(f"unknown HTTP method {bad[0]!r}; use e.g. [GET, POST]")
        return out


class StageSpec(_Strict):
    """A policed stage: its name (as in the policy's model) and its routes."""

    name: str = Field(min_length=1)
    path: str | None = None
    methods: tuple[str, ...] | None = None
    routes: tuple[Route, ...] = ()
    queue_cap: int | None = Field(default=None, ge=0)
    queue_timeout: float | None = Field(default=None, gt=0)
    # the stage whose request the client sends next on the same connection (van der Weij et al.'s
    # tandem): its thread decision is taken at this stage's completion, as in the model
    next: str | None = None
    # requests that may hold a lock others wait for (a database write transaction, a session
    # file): mod_overtake_prio never demotes them, for a demoted lock holder makes every waiter
    # wait at its priority. "unsafe": every method but GET and HEAD; "all"; or a list of methods
    cpu_exempt: str | tuple[str, ...] | None = None
    # a serialising resource (a database write lock): at most ``lock`` requests of the stage are
    # inside Apache at once, the others wait in the sidecar (controller.sidecar.stage_lock), where
    # the highest response ratio (wait + predicted) / predicted goes first; with ``lock_aging``
    # set, one that has waited that many seconds goes before them
    # ``auto``: the online loop's serialisation detector sets it (controller.online.lockwatch)
    lock: int | Literal["auto"] | None = None
    lock_aging: float | None = None
    # --cpu-priority class where the policy knows no phases: a keyed request whose predicted
    # holding time (its key's learned mean) exceeds the threshold starts at mod_overtake_prio's
    # low level (controller.sidecar.size_class); the threshold is ``class_threshold`` seconds, else
    # the ``class_quantile`` of the stage's recent predictions (the largest tenth demoted by default)
    class_threshold: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    class_quantile: float = Field(default=0.9, gt=0, lt=1)

    @field_validator("lock", mode="before")
    @classmethod
    def _lock(cls, v: object) -> int | str | None:
        if v is None or v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError("the number of requests of the stage that may hold its lock at once: an integer >= 1 "
                             "(1 for a database write lock), or auto (learned by the online loop from Apache's "
                             "request-time split); omit lock for a stage without one")
        return v

    @field_validator("lock_aging", mode="before")
    @classmethod
    def _aging(cls, v: object) -> float | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError("seconds a request waits for the lock before it goes ahead of every request that has "
                             "waited less: a number > 0 (e.g. 5.0), or omit it (the response ratio alone orders them)")
        return float(v)

    @model_validator(mode="after")
    def _aging_needs_lock(self) -> StageSpec:
        if self.lock is None and "lock_aging" in self.model_fields_set:
            raise ValueError("lock_aging applies to a stage with a lock: add lock: 1 (or the lock's capacity), or "
                             "remove lock_aging")
        return self

    @field_validator("path")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        return None if v is None else check_pattern(v)

    @field_validator("cpu_exempt")
    @classmethod
    def _exempt(cls, v: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        if v is None or v in ("all", "unsafe"):
            return v
        if isinstance(v, str):
            raise ValueError(f"must be 'unsafe' (every method but GET and HEAD), 'all' or a list of methods, got {v!r}")
        return Route._methods(v)

    def exempts(self, method: str) -> bool:
        """Is a request of ``method`` exempt from CPU demotion (``cpu_exempt``)? Without the key, a
        stage with a ``lock`` is exempt for every method: its requests hold the lock the others
        wait for (a demoted holder makes them all wait at its priority), and the solve's age
        prediction with a lock assumes it."""
        v = self.cpu_exempt
        if v is None:  # lock: auto is exempt once learned (the learned exemption of a serialised stage)
            return isinstance(self.lock, int)
        if isinstance(v, str):
            return v == "all" or (v == "unsafe" and method not in ("GET", "HEAD"))
        return method in v

    @model_validator(mode="after")
    def _one_form(self) -> StageSpec:
        if self.path is not None and self.routes:
            raise ValueError("give either path (with optional methods) or routes, not both")
        if self.path is None and not self.routes:
            raise ValueError("needs path: '<regex>' or routes: [{path: '<regex>'}]")
        if self.path is None and self.methods is not None:
            raise ValueError("methods belongs inside each route when routes is used")
        return self

    def all_routes(self) -> tuple[Route, ...]:
        if self.path is not None:
            return (Route(path=self.path, methods=self.methods),)
        return self.routes


class Passthrough(_Strict):
    """Requests no stage claims: forwarded with at most ``cap`` in Apache at once (None = no cap)."""

    cap: int | None = Field(default=None, ge=1)


class Limits(_Strict):
    """Gateway limits. Sizes in bytes, times in seconds."""

    max_inflight: int = Field(default=256, ge=1)  # global hard cap on requests inside Apache
    queue_cap: int = Field(default=1000, ge=0)  # per stage, unless the stage sets its own
    queue_timeout: float = Field(default=30.0, gt=0)
    retry_after: int = Field(default=1, ge=0)  # seconds, in 503 answers
    max_header_bytes: int = Field(default=16384, ge=256)
    max_body_bytes: int = Field(default=1 << 20, ge=0)
    response_buffer_bytes: int = Field(default=1 << 20, ge=0)
    # beyond the buffer, a response Apache has finished waits on disk (an unlinked temp file) for a
    # slow client up to this many bytes, so the client never holds a stage slot; 0 = never spill
    response_spill_bytes: int = Field(default=1 << 30, ge=0)
    # all responses spilled to disk together: beyond it, Apache's answers are read at their
    # clients' pace (the stage slot is then held longer), never failed
    spool_budget_bytes: int = Field(default=1 << 30, ge=0)
    max_tunnels: int = Field(default=1024, ge=0)  # open WebSocket tunnels (no stage slot each); 503 beyond
    upstream_timeout: float = Field(default=120.0, gt=0)  # longest silence of Apache within an answer (502)
    upstream_connect_timeout: float = Field(default=5.0, gt=0)  # seconds to connect to Apache
    client_timeout: float = Field(default=60.0, gt=0)  # idle keep-alive
    header_timeout: float = Field(default=10.0, gt=0)  # a whole request head (slowloris), as RequestReadTimeout
    # a request body must arrive within body_timeout s plus 1 s per body_min_rate bytes received
    # (Apache's RequestReadTimeout body=...,MinRate=...): a stalled or trickling body gets 408
    body_timeout: float = Field(default=20.0, gt=0)
    body_min_rate: int = Field(default=8192, gt=0)
    # request bodies held in memory by all connections together (declared lengths count from the
    # head): a body that would exceed it is refused with 503 + Retry-After before it is read
    body_budget_bytes: int = Field(default=32 << 20, ge=0)
    # a `next` reservation waits this long for its request, the reserved thread idle meanwhile:
    # about a loopback client's round trip (the Table 2 bench: mean 0.3 ms, all within 5 ms)
    follow_up_timeout: float = Field(default=0.005, gt=0)


    @model_validator(mode="after")
    def _budget_fits_a_body(self) -> Limits:
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(f"body_budget_bytes ({self.body_budget_bytes}) must be at least max_body_bytes "
                             f"({self.max_body_bytes}), or a largest body could never be received; raise it or "
                             "lower max_body_bytes")
        return self


class ClassifierSettings(_Strict):
    """Phase classification (van der Weij et al. needs the phase of waiting requests for ``full`` policies)."""

    mode: Literal["explicit", "learned", "hidden", "auto"] = "explicit"
    header: str = "X-Overtake-Phase"
    # seconds of service per model time unit; None: the policy's (controller.sidecar.units). Give it only
    # for a policy solved in an abstract unit (scenario time_unit: model, e.g. examples/table1)
    time_unit: float | None = Field(default=None, gt=0)
    next_header: str = "X-Overtake-Next-Phase"  # explicit mode: the phase of the `next` request
    history: int = Field(default=64, ge=1)  # learned: samples kept per route
    # auto (controller.sidecar.auto): run a policy only when predicted this much better than passthrough,
    # and re-check what the traffic shows every auto_interval seconds
    auto_margin: float = Field(default=0.02, ge=0, lt=1)
    auto_interval: float = Field(default=5.0, gt=0)


class StagesConfig(_Strict):
    """The whole stages file."""

    stages: tuple[StageSpec, ...] = Field(min_length=1)
    passthrough: Passthrough = Passthrough()
    limits: Limits = Limits()
    classifier: ClassifierSettings = ClassifierSettings()

    @model_validator(mode="after")
    def _unique(self) -> StagesConfig:
        names = [s.name for s in self.stages]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"stage names must be unique; {sorted(dup)[0]!r} appears twice")
        for s in self.stages:
            if s.next is not None and (s.next not in names or s.next == s.name):
                raise ValueError(
                    f"stage {s.name!r}: next must name another stage ({', '.join(n for n in names if n != s.name)}), "
                    f"got {s.next!r}"
                )
        linked = {s.next for s in self.stages if s.next is not None}
        for s in self.stages:
            if s.name not in linked and any(r.key and "link" in r.key for r in s.all_routes()):
                raise ValueError(f"stage {s.name!r}: key part 'link' needs a stage with next: {s.name} "
                                 "(the link is the previous stage's request on the same connection)")
        return self


@dataclass(frozen=True)
class _CompiledRoute:
    regex: LinearRegex
    query: LinearRegex | None
    methods: frozenset[str] | None
    stage: int
    phase: int | None  # 0-based
    key: str  # the route's identity
    key_parts: tuple[str, ...] | None  # learned classification's key (None: method and path)


def _body_bin(n: int | None) -> str:
    """Half-octave bin of a body length: sizes within a factor of about 1.4 share a bin."""
    return "-" if n is None else str(int(2 * math.log2(n + 1)))


def _param(query: str, name: str) -> str:
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k == name:
            return v
    return ""


class StageTable:
    """Compiled routes: ``route(method, path)`` -> (stage index, route key, fixed phase) or None."""

    def __init__(self, config: StagesConfig) -> None:
        self.config = config
        self.names: tuple[str, ...] = tuple(s.name for s in config.stages)
        self.next_stage: tuple[int | None, ...] = tuple(
            None if s.next is None else self.names.index(s.next) for s in config.stages)
        routes = []
        for i, st in enumerate(config.stages):
            for r in st.all_routes():
                routes.append(
                    _CompiledRoute(
                        LinearRegex(r.path), None if r.query is None else LinearRegex(r.query),
                        frozenset(r.methods) if r.methods else None, i,
                        None if r.phase is None else r.phase - 1,
                        f"{st.name}:{r.path}" + ("" if r.query is None else f"?{r.query}"), r.key,
                    )
                )
        self._routes = tuple(routes)
        self._by_key = {r.key: r for r in routes}
        #: stages whose routes key on the previous stage's request (``link``)
        self.linked: tuple[bool, ...] = tuple(
            any(r.key is not None and "link" in r.key for r in st.all_routes()) for st in config.stages)

    def route(self, method: str, path: str, query: str = "") -> tuple[int, str, int | None] | None:
        """(stage, route identity, fixed phase) of the first route matching, or None."""
        for r in self._routes:
            if ((r.methods is None or method in r.methods) and r.regex.match(path)
                    and (r.query is None or r.query.search(query))):
                return r.stage, r.key, r.phase
        return None

    def learned_key(self, route: str, method: str, path: str, query: str = "", body_size: int | None = None,
                    link: str = "") -> str:
        """The key a request's service demands are learned under (see the module's docstring).

        >>> t = StageTable(StagesConfig.model_validate({"stages": [{"name": "edit", "routes": [
        ...     {"path": "^/index[.]php$", "key": ["param:title", "body_size"]}]}]}))
        >>> t.learned_key("edit:^/index[.]php$", "POST", "/index.php", "title=Main&action=submit", 3000)
        'POST edit:^/index[.]php$ title=Main 23'
        >>> t.learned_key("edit:^/index[.]php$", "GET", "/index.php", "title=Main")
        'GET edit:^/index[.]php$ title=Main -'
        """
        r = self._by_key.get(route)
        if r is None or r.key_parts is None:
            return method + " " + path
        values = []
        for part in r.key_parts:
            if part == "path":
                values.append(path)
            elif part == "query":
                values.append("?" + query)
            elif part == "body_size":
                values.append(_body_bin(body_size))
            elif part != "link":
                name = part.removeprefix("param:")
                values.append(f"{name}={_param(query, name)}")
        if "link" in r.key_parts:
            # the previous request names the transaction; with ``link`` alone the key is known
            # when that request completes, so the reservation can predict the follow-up's phase
            return " ".join(("<" + link, *values))
        return " ".join((method, r.key, *values))

    def follow_up_key(self, stage: int, previous: str) -> str:
        """The learned key of a linked stage's follow-up, as far as it is known when the previous
        request completes: the key of the stage's routes keyed on ``link`` alone (the follow-up
        is taken to be one of theirs), else "" (the prior)."""
        if not self.linked[stage]:
            return ""
        keys = {r.key_parts for r in self._routes if r.stage == stage}
        return "<" + previous if ("link",) in keys else ""

    def cpu_exempt(self, stage: int, method: str) -> bool:
        """Is a request of ``stage`` and ``method`` exempt from CPU demotion (the stage's ``cpu_exempt``)?"""
        return self.config.stages[stage].exempts(method)

    def class_threshold(self, stage: int) -> tuple[float | None, float]:
        """The stage's size-class threshold: (``class_threshold`` seconds or None, ``class_quantile``)."""
        st = self.config.stages[stage]
        return st.class_threshold, st.class_quantile

    def lock(self, stage: int) -> int | None:
        """The stage's configured lock capacity (``lock: m``), None without one (or ``auto``)."""
        m = self.config.stages[stage].lock
        return m if isinstance(m, int) else None

    def lock_auto(self, stage: int) -> bool:
        """Does the online loop set the stage's lock (``lock: auto``)?"""
        return self.config.stages[stage].lock == "auto"

    def keyed(self, stage: int) -> bool:
        """Does some route of the stage set a learned-classification ``key``?"""
        return any(r.key is not None for r in self.config.stages[stage].all_routes())

    def queue_cap(self, stage: int) -> int:
        c = self.config.stages[stage].queue_cap
        return self.config.limits.queue_cap if c is None else c

    def queue_timeout(self, stage: int) -> float:
        t = self.config.stages[stage].queue_timeout
        return self.config.limits.queue_timeout if t is None else t


def _field(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "stages file"


def load_stages(path: str | Path) -> StageTable:
    """Read and validate a stages YAML file.

    Raises
    ------
    SidecarInputError
        One line naming the file, the field and the fix, e.g.
        ``stages.yaml: stages[1].path: not a valid regular expression (...)``.
    FileNotFoundError
        If the file does not exist.
    """
    p = Path(path)
    text = p.read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise SidecarInputError(f"{p}:{where} not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise SidecarInputError(f"{p}: must be a mapping with a 'stages' list (see examples/sidecar/stages.yaml)")
    try:
        cfg = StagesConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key; check the spelling against examples/sidecar/stages.yaml"
        elif err["type"] == "missing":
            msg = "required field is missing"
        raise SidecarInputError(f"{p}: {_field(tuple(err['loc']))}: {msg} (got {err.get('input')!r})") from None
    return StageTable(cfg)
