"""What the control endpoints see of a running sidecar: the policy in force and its sources, for
:class:`~overtake.controller.sidecar.admin.AdminEndpoints` (``GET``/``PUT /-/policy``).
"""

from __future__ import annotations

from typing import Any

from overtake.controller.sidecar.admin import AdminAccess
from overtake.controller.sidecar.cpu_choice import CpuChoice
from overtake.controller.sidecar.module_stages import ModuleStageCheck
from overtake.controller.sidecar.policies import PolicySet
from overtake.controller.sidecar.policy_in_force import PolicyInForce
from overtake.controller.sidecar.policy_source import PolicySource

__all__ = ["AdminView"]


class AdminView(PolicyInForce):
    """The narrow view :class:`~overtake.controller.sidecar.admin.PolicyControl` asks for."""

    source: PolicySource
    cpu_choice: CpuChoice
    module_stages: ModuleStageCheck | None

    def _admin_access(self) -> AdminAccess:
        return AdminAccess(self.options.guards.admin_put, self.options.guards.admin_token)

    def url_allowed(self, url: str) -> bool:
        """May ``PUT /-/policy`` follow ``url``?"""
        return self.source.url_allowed(url)

    async def follow(self, url: str) -> None:
        """Take the policy from ``url`` now and poll it from then on."""
        await self.source.follow(url)

    def unfollow(self) -> None:
        """An explicit policy replaced the API's: stop following it."""
        self.source.unfollow()

    def policy_info(self) -> dict[str, Any]:
        """The body of ``GET /-/policy``."""
        p = self.policy
        online = self.online
        return {
            "name": p.name, "version": p.version, "hash": p.hash, "phases": list(p.phases),
            "per_phase_queues": p.per_phase_queues, "phase_info": p.phase_info,
            "predicted_response_time_model_units": p.predicted_wait,
            "predicted_response_time_seconds": None if p.predicted_wait is None else p.predicted_wait * self.time_unit,
            "time_unit": self.time_unit,
            "phase_names": None if p.model_phases is None else [list(n) for n in p.model_phases],
            "swapped_at": self.swapped_at, "swaps": self.metrics.swaps, "refused": self.metrics.refused,
            "classifier": self.classifier.mode, "cpu_priority": self.options.apache_side.cpu_priority,
            "cpu_priority_choice": self.cpu_choice.info(), **self.source.info(),
            **({"auto": {"chosen": p.chosen.name, "phase_info": p.chosen.phase_info, "reason": p.reason,
                         "predicted_gain": p.predicted_gain, "candidates": [m.name for m in p.members]}}
               if isinstance(p, PolicySet) else {}),
            **({"online": online.status()} if online is not None else {}),
            **({"lock": self.limiter.lock.info(self.policy)} if self.limiter.lock is not None else {}),
            **({"module_stages": self.module_stages.info()} if self.module_stages is not None else {}),
            **({"size_class": self.size_class.info()} if self.size_class is not None else {}),
            **({"verify": self.verifier.status()} if self.verifier is not None else {}),
            **({"stacks": self.stacks.info()} if self.stacks.stacks else {}),
        }
