"""The policy in force: its time unit, auto's choice among its candidates, and the swap paths.

A swap loads and validates a new policy (:func:`overtake.controller.sidecar.policies.load_policy`),
and only then installs it with :meth:`overtake.controller.sidecar.limiter.Limiter.swap`: one
synchronous step on the event loop, so no request ever sees half a policy; queued requests keep
their order. A policy that fails to load or does not match the stages raises
:class:`overtake.controller.errors.PolicyLoadError` and the old policy stays. Policies from
outside are loaded by :meth:`PolicyInForce.install`: in a worker thread under a deadline
(``policy_load_timeout``), one at a time (:mod:`overtake.controller.sidecar.policy_loads`).

The time unit (seconds per model time unit) comes from the policy, else the stages file
(:mod:`overtake.controller.sidecar.units`); every time the sidecar shows is in seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from overtake.controller.cpu_location import CpuLocation, StackWatch
from overtake.controller.errors import PolicyLoadError, SidecarInputError
from overtake.controller.online import OnlineLoop
from overtake.controller.sidecar.auto import choose
from overtake.controller.sidecar.classifier import Classifier
from overtake.controller.sidecar.control_file import ControlPublisher
from overtake.controller.sidecar.count_table import module_blocker
from overtake.controller.sidecar.fpm_pool import pool_warning
from overtake.controller.sidecar.limiter import Limiter
from overtake.controller.sidecar.metrics import SidecarMetrics
from overtake.controller.sidecar.module_mode import enforce_for
from overtake.controller.sidecar.options import SidecarOptions
from overtake.controller.sidecar.policies import (
    BaselinePolicy,
    PolicySet,
    SpawnPolicy,
    class_levels,
    load_policy,
    load_policy_bytes,
)
from overtake.controller.sidecar.policy_loads import LoadSlots
from overtake.controller.sidecar.size_class import SizeClass
from overtake.controller.sidecar.stages import StagesConfig, StageTable
from overtake.controller.sidecar.units import FORMER_DEFAULT, Resolution, resolve, units_of
from overtake.controller.sidecar.verify import Verifier

__all__ = ["PolicyInForce"]

log = logging.getLogger("overtake.sidecar")


class PolicyInForce:
    """The sidecar's running policy (:class:`~overtake.controller.sidecar.service.Sidecar` is one,
    running as :class:`~overtake.controller.sidecar.running.SidecarRuntime`)."""

    table: StageTable
    options: SidecarOptions
    limiter: Limiter
    classifier: Classifier
    metrics: SidecarMetrics
    online: OnlineLoop | None
    control: ControlPublisher | None
    cpu_location: CpuLocation
    stacks: StackWatch
    loads: LoadSlots
    auto: bool
    time_unit: float
    swapped_at: float
    verifier: Verifier | None
    module_mode: bool
    fpm_pool: tuple[str, int] | None
    _warned_unrecorded: set[str]
    _class_key: tuple[object, object] | None
    _class_levels: tuple[tuple[int, ...], ...] | None
    size_class: SizeClass | None

    @property
    def policy(self) -> SpawnPolicy:
        """The sidecar's policy: in force, or under verification against Apache's default."""
        return self.limiter.policy if self.verifier is None else self.verifier.chosen

    # ---- the time unit (controller.sidecar.units) -------------------------------------------------
    def _resolve_unit(self, policy: SpawnPolicy, stages: StagesConfig | None = None) -> Resolution:
        """The unit ``policy`` runs at under ``stages``' ``classifier.time_unit`` (default: the
        running stages file's); raises :class:`PolicyLoadError` (one line naming both values and
        the fix) when they disagree. Warns once per policy that recorded no unit."""
        res = resolve(units_of(policy), (stages or self.table.config).classifier.time_unit)
        for name in res.unrecorded:
            if name not in self._warned_unrecorded:
                self._warned_unrecorded.add(name)
                used = res.seconds if res.seconds is not None else FORMER_DEFAULT
                log.warning(f"policy {name} records no time unit (solved by an older overtake): its model times are "
                            f"taken as {used:g} s per unit ({res.source}); re-solve it with `overtake solve` to "
                            "carry its unit", extra={"event": "time_unit_unrecorded", "policy": name})
        return res

    def _say_unit(self, source: str) -> None:
        log.info(f"time unit: {self.time_unit:g} s per model time unit ({source})",
                 extra={"event": "time_unit", "detail": source})

    def _set_time_unit(self, seconds: float, source: str) -> None:
        """Run at a new unit from now on: the classifier's learned demands and the online loop's
        samples are rescaled, metrics and logs convert with it."""
        if seconds == self.time_unit:
            return
        self.time_unit = seconds
        self.classifier.set_time_unit(seconds)
        self.metrics.time_unit = seconds
        if self.online is not None:
            self.online.set_time_unit(seconds)
        self._say_unit(source)

    @staticmethod
    def _say_age_threshold(policy: SpawnPolicy, time_unit: float, *, warn: bool = True) -> None:
        """Log the age threshold the policy file's model chose, in seconds of thread CPU: the
        value for Apache's ``OvertakePrioLevels`` (the sidecar cannot set it)."""
        members = policy.members if isinstance(policy, PolicySet) else (policy,)
        for p in members:
            th = ((getattr(p, "priority_predictions", None) or {}).get("age") or {}).get("thresholds")
            if th and th[0] and th[0][0] is not None:
                secs = float(th[0][0]) * time_unit
                log.info(f"cpu_priority age: the model's threshold is {secs:.4g} s of thread CPU; Apache "
                         f"should run OvertakePrioLevels {secs:.4g} (mod_overtake_prio)",
                         extra={"event": "cpu_priority_threshold", "detail": f"{th[0][0]:.4g} model units x "
                                f"time_unit {time_unit:g} s, from {p.name}"})
                return
        if not warn:  # a swapped-in policy without a prediction under age priority: nothing new to say
            return
        log.warning("cpu_priority age: no policy file carries a prediction with age priority; solve with "
                    "`overtake solve --cpu-priority age` so that auto can weigh it", extra={"event": "cpu_priority_threshold"})

    def _cpu_class(self, stage: int, label: int, key: str = "", method: str = "GET") -> int | None:
        """mod_overtake_prio's starting level for a request of ``stage`` with ``label`` under the
        policy in force (short-first classes, :func:`~overtake.controller.sidecar.policies.class_levels`);
        where the policy knows no classes, from the size predicted under the request's learned
        ``key`` (:mod:`~overtake.controller.sidecar.size_class`), never for a request exempt from
        demotion (``method``)."""
        pol = self.limiter.policy
        held = (pol, getattr(pol, "chosen", pol))  # held, so a new policy is never mistaken for it
        if self._class_key is None or held[0] is not self._class_key[0] or held[1] is not self._class_key[1]:
            self._class_key, self._class_levels = held, class_levels(pol)
        lv = self._class_levels
        if lv is not None and stage < len(lv) and 0 <= label < len(lv[stage]):
            return lv[stage][label]
        sc = self.size_class
        if sc is None or not sc.eligible(stage) or self._demotion_exempt(stage, method):
            return None
        level = sc.level(stage, key)
        if level:
            self.metrics.class_low.labels(self.table.names[stage]).inc()
        return level

    def _demotion_exempt(self, stage: int, method: str) -> bool:
        """Never demoted: the stage's ``cpu_exempt`` covers ``method``, or the online loop found it serialised."""
        gw = getattr(self, "gateway", None)
        return self.table.cpu_exempt(stage, method) or (gw is not None and stage in gw.screening.learned_exempt)

    # ---- auto (controller.sidecar.auto) ------------------------------------------------------------
    def _as_set(self, policy: SpawnPolicy) -> PolicySet:
        if isinstance(policy, PolicySet):
            return policy
        members = [] if isinstance(policy, BaselinePolicy) else [policy]
        return PolicySet(members, policy.name, len(self.table.names))

    def _auto_choose(self, ps: PolicySet, *, initial: bool = False) -> bool:
        """Choose among ``ps``'s members for the evidence so far; True when the choice changed.
        The caller installs ``ps`` (``initial``: the limiter is built with it next)."""
        ev = self.classifier.evidence
        assert ev is not None
        settings = self.table.config.classifier
        choice = choose(ps.members, ev.available(), ps.passthrough, margin=settings.auto_margin,
                        cpu_priority=self._cpu_priority_in_reach())
        changed = choice.policy is not ps.chosen or initial
        ps.adopt(choice.policy, choice.reason, choice.predicted_gain)
        if changed:
            self.classifier.mode = choice.mode
            log.info("auto: " + choice.reason, extra={
                "event": "auto_choice", "policy": choice.policy.name, "detail": f"information {choice.info}, "
                f"classifier {choice.mode}, available {', '.join(sorted(ev.available()))}, "
                f"needs enforce: {enforce_for(choice.info, self.options.uplink.name)}"
                + "".join(f"; stage {s}: {st.said()}" for s, st in self.stacks.stacks.items())})
        return changed

    def _cpu_priority_in_reach(self) -> str:
        """The CPU priority auto may count on: ``cpu_priority``, unless the CPU runs in PHP-FPM,
        where mod_overtake_prio cannot act and no PHP extension's counters are given, or no
        stage's work runs where a lever reaches it (the module's per-stage counters)."""
        if self.cpu_location.module_reaches is False and not self.options.apache_side.php_stats_file:
            return "off"
        if self.stacks.none_reached():
            return "off"
        return self.options.apache_side.cpu_priority

    # ---- the swap paths --------------------------------------------------------------------
    async def install(self, spec: str, *, source: str, data: bytes | None = None) -> SpawnPolicy:
        """Load ``spec`` (or ``data``, the bytes of an ``.npz`` named ``spec``) in a worker thread
        under ``policy_load_timeout`` and install it atomically; loads are bounded by
        :class:`~overtake.controller.sidecar.policy_loads.LoadSlots` (one at a time, a few waiting). On
        any error keep the old policy and raise :class:`PolicyLoadError` (one line, naming the
        field; :class:`~overtake.controller.sidecar.policy_loads.LoadBusy` when no slot is free)."""
        opts = self.options
        names = self.table.names

        def load() -> SpawnPolicy:
            if data is not None:
                return load_policy_bytes(data, spec, names, max_array_bytes=opts.policy.max_array_bytes,
                                         max_inflated_bytes=opts.policy.max_inflated_bytes)
            return load_policy(spec, names, max_bytes=opts.policy.max_bytes,
                               max_array_bytes=opts.policy.max_array_bytes,
                               max_inflated_bytes=opts.policy.max_inflated_bytes)

        try:
            new = await self._load(load, spec)
            res = self._resolve_unit(new)
            self._check_module(new)
        except (PolicyLoadError, SidecarInputError) as exc:
            self._refused(exc, source)
            raise
        return self._install(new, source, res)

    async def _load(self, load: Callable[[], SpawnPolicy], spec: str) -> SpawnPolicy:
        """``load()`` through the load slots, every failure turned into one-line PolicyLoadError."""
        timeout = self.options.policy.load_timeout
        try:
            return await self.loads.run(load, timeout, spec)
        except TimeoutError:
            raise PolicyLoadError(f"policy: loading {spec} took longer than policy_load_timeout = {timeout:g} s; "
                                  "raise it for a very large policy") from None
        except (PolicyLoadError, SidecarInputError):
            raise
        except Exception as exc:  # noqa: BLE001 - any malformed file is refused, never a traceback
            raise PolicyLoadError(f"policy: {spec}: not a usable policy ({exc.__class__.__name__}: {exc})") from None

    def swap(self, spec: str, *, source: str) -> SpawnPolicy:
        """Load ``spec`` on the calling thread and install it atomically (the online loop's own
        solved files); on any error keep the old policy and raise."""
        try:
            new = load_policy(spec, self.table.names, max_bytes=self.options.policy.max_bytes,
                              max_array_bytes=self.options.policy.max_array_bytes,
                              max_inflated_bytes=self.options.policy.max_inflated_bytes)
            res = self._resolve_unit(new)
            self._check_module(new)
        except (PolicyLoadError, SidecarInputError) as exc:
            self._refused(exc, source)
            raise
        return self._install(new, source, res)

    def _refused(self, exc: Exception, source: str) -> None:
        self.metrics.refused += 1
        log.error("policy refused, old policy kept", extra={
            "event": "policy_refused", "source": source, "detail": str(exc), "policy": self.policy.name,
        })

    def _install(self, new: SpawnPolicy, source: str, unit: Resolution) -> SpawnPolicy:
        old = self.policy
        if self.auto:
            new = self._as_set(new)
            self._auto_choose(new, initial=True)
        elif isinstance(new, PolicySet):
            raise PolicyLoadError(f"policy: {new.name} is a directory of policies; that needs classifier.mode: auto")
        if unit.seconds is not None:
            self._set_time_unit(unit.seconds, unit.source)
        self.limiter.swap(new)
        self.metrics.swaps += 1
        self.swapped_at = time.time()
        log.info("policy swapped", extra={
            "event": "policy_swap", "source": source, "policy": new.name, "hash": new.hash,
            "version": new.version, "detail": f"from {old.name} ({old.hash})",
        })
        if self.control is not None:
            self.control.publish(new, self.time_unit)
        elif self.options.apache_side.cpu_priority == "age":
            self._say_age_threshold(new, self.time_unit, warn=False)
        self._say_pool(new)
        if self.verifier is not None:
            self.verifier.adopt(new)
        return new

    def _say_pool(self, policy: SpawnPolicy) -> None:
        """Warn when ``policy`` may run more requests than PHP-FPM's pool has workers."""
        if self.fpm_pool is None:
            return
        warning = pool_warning(policy, *self.fpm_pool)
        if warning is not None:
            log.warning(warning, extra={"event": "config_warning", "policy": policy.name, "detail": warning})

    def _check_module(self, new: SpawnPolicy) -> None:
        """Module mode enforces count tables only: refuse a policy that sees phases or routes."""
        why = module_blocker(new) if self.module_mode else None
        if why is not None:
            raise PolicyLoadError(f"policy: {why}")
