"""The sidecar's YAML config file (``overtake sidecar --config FILE``) as a pydantic schema.

Every key is an ``overtake sidecar`` option with ``-`` written ``_`` (``--policy-url`` is
``policy_url``); the online loop's options sit under ``online:``. A flag given on the command line
overrides the file's key. Relative paths in the file (``stages``, ``policy``, ``request_log``,
``policy_token_file``, ``admin_token_file``, ``php_stats_file``, ``online.access_log``) are taken relative to the
file's folder, so a unit file may run the sidecar from any working directory. The live
verification's options sit under ``verify:`` (``enabled``, ``window``, ``settle``, ``min_pairs``,
``max_pairs``, ``min_gain``, ``level``, ``min_requests``). Tokens are best kept
out of the file and the command line: ``policy_token_file`` and ``admin_token_file`` name files
holding them (mode 0600); a SIGHUP re-reads them.

An unknown key or a bad value is refused with one line naming the file, the key and the fix,
e.g. ``sidecar.yaml: drain_timout: unknown key; known keys: admin_listen, ...``. Example:
``apache-conf/examples/sidecar.yaml``.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from overtake.controller.errors import SidecarInputError
from overtake.controller.online import OnlineSettings
from overtake.controller.sidecar.admin import DEFAULT_ADMIN_LISTEN
from overtake.controller.sidecar.options import SidecarOptions
from overtake.controller.sidecar.policies import MAX_ARRAY_BYTES, MAX_INFLATED_BYTES, MAX_POLICY_BYTES
from overtake.controller.sidecar.verify_settings import VerifySettings
from overtake.controller.uplink.bands import TOP_FRACTION

__all__ = ["OnlineConfig", "SidecarConfig", "VerifyConfig", "load_config", "to_options"]


class OnlineConfig(BaseModel):
    """``online:`` — the online refit loop (:mod:`overtake.controller.online`)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    refit_interval: float = Field(60.0, gt=0)
    min_samples: int = Field(200, ge=1)
    arrival_window: float = Field(60.0, gt=0)
    access_log: str | None = None
    swap_margin: float = Field(0.01, ge=0)
    refit_tolerance: float = Field(0.01, gt=0)


class VerifyConfig(BaseModel):
    """``verify:`` — the policy against Apache's default on live traffic (:mod:`overtake.controller.sidecar.verify`)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    window: float = Field(30.0, gt=0)
    settle: float = Field(5.0, ge=0)
    min_pairs: int = Field(3, ge=2)
    max_pairs: int = Field(20, ge=2)
    min_gain: float = Field(0.02, gt=-1, lt=1)
    level: float = Field(0.95, ge=0.5, lt=1)
    min_requests: int = Field(20, ge=1)


class SidecarConfig(BaseModel):
    """The whole file; defaults are those of the command line."""

    model_config = ConfigDict(extra="forbid")

    apache: str
    #: required with enforce: sidecar (load_config); module mode serves no traffic, so needs none
    listen: str | None = None
    stages: str
    policy: str | None = None
    policy_url: str | None = None
    policy_poll: float = Field(10.0, gt=0)
    policy_token: str | None = None
    policy_token_file: str | None = None
    phase_header: str | None = None
    uplink: str = "fair"
    uplink_cutoffs: str | None = None
    uplink_top_fraction: float = Field(TOP_FRACTION, gt=0, lt=1)
    uplink_lowest_writers: int = Field(0, ge=0)
    uplink_ordered_bands: int = Field(1, ge=1)
    loop: Literal["uvloop", "asyncio"] = "uvloop"
    cpu_priority: Literal["off", "auto", "age", "class"] = "off"
    gate: str | None = None
    gate_slots: int = Field(64, ge=1, le=1 << 20)
    gate_backfill: int = Field(1, ge=0, le=1024)
    php_stats_file: str | None = None
    fpm_pool_config: str | None = None
    control_file: str | None = None
    #: sidecar: requests pass through the proxy; module: mod_overtake_prio enforces the count table
    enforce: Literal["sidecar", "module"] = "sidecar"
    watch_interval: float = Field(1.0, gt=0)
    admin_listen: str = DEFAULT_ADMIN_LISTEN
    admin_put: bool = True
    admin_token: str | None = None
    admin_token_file: str | None = None
    admin_policy_urls: list[str] = Field(default_factory=list)
    policy_max_bytes: int = Field(MAX_POLICY_BYTES, gt=0)
    policy_max_array_bytes: int = Field(MAX_ARRAY_BYTES, gt=0)
    policy_max_inflated_bytes: int = Field(MAX_INFLATED_BYTES, gt=0)
    policy_load_timeout: float = Field(10.0, gt=0)
    status_interval: float = Field(5.0, gt=0)
    drain_timeout: float = Field(30.0, ge=0)
    request_log: str | None = None
    request_log_format: Literal["json", "combined"] = "json"
    #: clients whose X-Overtake-Phase / -Next-Phase / -Class headers are honoured (CIDRs); from anyone
    #: else they are stripped, so a client cannot claim the short phase or a CPU class
    trusted_sources: list[str] = Field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    online: OnlineConfig | None = None
    verify: VerifyConfig | None = None

    @field_validator("trusted_sources")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for cidr in v:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an address or CIDR, e.g. 10.0.0.0/8 or 192.0.2.7") from None
        return v


_PATHS = ("stages", "request_log", "policy_token_file", "admin_token_file", "php_stats_file", "fpm_pool_config")


def _field(loc: tuple[Any, ...]) -> str:
    return ".".join(str(x) for x in loc) or "(top level)"


def _is_file_spec(policy: str) -> bool:
    text = policy.strip()
    return not (text == "passthrough" or text.replace(" ", "").startswith(("pi(", "π(")))


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> SidecarConfig:
    """The config in ``path`` (None: none) with ``overrides`` (the flags given) on top.

    Raises
    ------
    SidecarInputError
        Unreadable file, not YAML, not a mapping, an unknown key, a bad value or a missing
        required key (``apache``, ``stages``; ``listen`` unless ``enforce: module``): one line
        naming the key and the fix.
    """
    where = str(path) if path is not None else "command line"
    data = _read_file(Path(path)) if path is not None else {}
    _apply_overrides(data, overrides)
    try:
        cfg = SidecarConfig.model_validate(data)
    except ValidationError as exc:
        raise SidecarInputError(f"{where}: {_validation_message(exc)}") from None
    if cfg.listen is None and cfg.enforce == "sidecar":
        raise SidecarInputError(f"{where}: listen: required: set it in the config file or give --listen (where "
                                "clients connect, e.g. 0.0.0.0:80); only enforce: module, where Apache serves the "
                                "traffic, needs none")
    return cfg


def _read_file(p: Path) -> dict[str, Any]:
    """The config file's mapping, its relative paths resolved against the file's folder (so the
    file means the same whatever the working directory)."""
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SidecarInputError(f"config: cannot read {p} ({exc.strerror}); give the sidecar's YAML file") from None
    except UnicodeDecodeError as exc:
        raise SidecarInputError(f"{p}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                                "save the file as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise SidecarInputError(f"{p}: not valid YAML{at}; check the indentation and quoting") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SidecarInputError(f"{p}: must be a mapping of option: value (see apache-conf/examples/sidecar.yaml)")
    base = p.resolve().parent
    data = dict(raw)
    for key in _PATHS:
        if isinstance(data.get(key), str) and data[key] != "-":
            data[key] = str(base / os.path.expanduser(data[key]))
    if isinstance(data.get("policy"), str) and _is_file_spec(data["policy"]):
        data["policy"] = str(base / os.path.expanduser(data["policy"]))
    online = data.get("online")
    if isinstance(online, dict) and isinstance(online.get("access_log"), str):
        data["online"] = {**online, "access_log": str(base / os.path.expanduser(online["access_log"]))}
    return data


def _apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    """The flags given on top of the file: plain keys replace, the ``online`` and ``verify``
    sections merge key by key, and only where the section is on (a ``--verify-*`` flag without
    ``--verify`` or ``verify:`` is refused: it would silently do nothing)."""
    online_flags = overrides.pop("online", None)
    verify_flags = overrides.pop("verify", None)
    data.update({k: v for k, v in overrides.items() if v is not None})
    if online_flags and ("online" in data or online_flags.get("enabled")):
        data["online"] = {**(data.get("online") or {}), **online_flags}
    if verify_flags and ("verify" in data or verify_flags.get("enabled")):
        data["verify"] = {**(data.get("verify") or {}), **verify_flags}
    elif verify_flags:
        flag = "--verify-" + next(iter(verify_flags)).replace("_", "-")
        raise SidecarInputError(f"{flag}: only with --verify (or verify: in the config file); add --verify")


def _validation_message(exc: ValidationError) -> str:
    """The first validation error as one line: the key, what is wrong and the fix (an unknown
    key lists the known ones, a missing one names its flag), with the value given."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        sections: dict[str, type[BaseModel]] = {"online": OnlineConfig, "verify": VerifyConfig}
        model = sections.get(str(loc[0]), SidecarConfig) if len(loc) > 1 else SidecarConfig
        msg = f"unknown key; known keys: {', '.join(sorted(model.model_fields))}"
    elif err["type"] == "missing":
        flag = "--" + str(loc[-1]).replace("_", "-")
        msg = f"required: set it in the config file or give {flag}"
    got = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err.get('input')!r})"
    return f"{_field(loc)}: {msg}{got}"


def _token(value: str | None, file: str | None, kind: str) -> str | None:
    """``{kind}_token``, or the content of ``{kind}_token_file`` (one of them; an empty one is none)."""
    if file:
        if value:
            raise SidecarInputError(f"{kind}_token_file: give either {kind}_token or {kind}_token_file, not both")
        try:
            value = Path(file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise SidecarInputError(f"{kind}_token_file: cannot read {file} ({why})") from None
    return value or None


def to_options(cfg: SidecarConfig) -> SidecarOptions:
    """The :class:`~overtake.controller.sidecar.options.SidecarOptions` of a validated config.

    Raises
    ------
    SidecarInputError
        Neither ``policy`` nor ``policy_url``, both tokens, or an unreadable token file.
    """
    if not cfg.policy and not cfg.policy_url:
        raise SidecarInputError("policy: give policy (a file, pi(k), passthrough) or policy_url in the config, "
                                "or --policy / --policy-url")
    token = _token(cfg.policy_token, cfg.policy_token_file, "policy")
    admin_token = _token(cfg.admin_token, cfg.admin_token_file, "admin")
    on = cfg.online
    online = None
    if on is not None and on.enabled:
        online = OnlineSettings(
            refit_interval=on.refit_interval, min_samples=on.min_samples, arrival_window=on.arrival_window,
            reservoir=max(2000, on.min_samples), margin=on.swap_margin, tolerance=on.refit_tolerance,
            access_log=on.access_log,
        )
    ve = cfg.verify
    verify = None
    if ve is not None and ve.enabled:
        verify = VerifySettings(window=ve.window, settle=ve.settle, min_pairs=ve.min_pairs, max_pairs=ve.max_pairs,
                                min_gain=ve.min_gain, level=ve.level, min_requests=ve.min_requests)
    return SidecarOptions.from_flat(
        policy=cfg.policy or "", apache=cfg.apache, listen=cfg.listen, phase_header=cfg.phase_header,
        uplink=cfg.uplink, uplink_cutoffs=cfg.uplink_cutoffs, uplink_top_fraction=cfg.uplink_top_fraction,
        uplink_lowest_writers=cfg.uplink_lowest_writers, uplink_ordered_bands=cfg.uplink_ordered_bands,
        watch_interval=cfg.watch_interval, admin_put=cfg.admin_put, online=online, policy_url=cfg.policy_url,
        policy_poll=cfg.policy_poll, policy_token=token, admin_listen=cfg.admin_listen, admin_token=admin_token,
        admin_policy_urls=tuple(cfg.admin_policy_urls), policy_max_bytes=cfg.policy_max_bytes,
        policy_max_array_bytes=cfg.policy_max_array_bytes, policy_max_inflated_bytes=cfg.policy_max_inflated_bytes,
        policy_load_timeout=cfg.policy_load_timeout,
        status_interval=cfg.status_interval, drain_timeout=cfg.drain_timeout, request_log=cfg.request_log,
        request_log_format=cfg.request_log_format, trusted_sources=tuple(cfg.trusted_sources),
        cpu_priority=cfg.cpu_priority, gate=cfg.gate, gate_slots=cfg.gate_slots,
        php_stats_file=cfg.php_stats_file, fpm_pool_config=cfg.fpm_pool_config, control_file=cfg.control_file,
        gate_backfill=cfg.gate_backfill, verify=verify, enforce=cfg.enforce,
    )
