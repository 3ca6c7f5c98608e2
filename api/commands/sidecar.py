"""``overtake sidecar``: enforce a thread policy in front of an unmodified Apache.

Benchmarks call exactly::

    overtake sidecar --policy (FILE | "pi(k)" | "pi(k1,k2)" | passthrough) --apache URL
                     --listen ADDR --stages FILE [--phase-header NAME] [--uplink fair]
                     [--online [--refit-interval S] [--min-samples N] [--arrival-window S]
                      [--access-log PATH] [--swap-margin F] [--refit-tolerance F]]
                     [--verify [--verify-window S] [--verify-settle S] [--verify-min-pairs N]
                      [--verify-max-pairs N] [--verify-min-gain F] [--verify-level F]]
    overtake sidecar --policy-url http://API/v1/models/ID/policy.npz [--policy-poll 10]
                     [--policy-token TOKEN] [--policy FALLBACK] --apache URL --listen ADDR --stages FILE
    overtake sidecar --config sidecar.yaml [any flag above, overriding the file]

As a service: SIGTERM drains (stop accepting, finish what was received, within --drain-timeout,
then exit 0); SIGHUP re-reads --config and the stages file (applying what can change live,
controller.sidecar.stages_reload) and reloads the policy and the request log.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any

from overtake.controller.errors import SidecarInputError

if TYPE_CHECKING:
    from overtake.controller.sidecar.config import SidecarConfig
    from overtake.controller.sidecar.options import SidecarOptions
    from overtake.controller.sidecar.service import Sidecar
    from overtake.controller.sidecar.stages import StageTable

#: overtake.controller.uplink.bands.TOP_FRACTION, written out so that parsing the options imports nothing
#: of the sidecar (tests/api/test_cli_startup.py checks they agree)
TOP_FRACTION = 0.005

log = logging.getLogger("overtake.sidecar")
_ONLINE_FLAGS = ("refit_interval", "min_samples", "arrival_window", "access_log", "swap_margin", "refit_tolerance")
#: --verify-X flags: (flag, config key under verify:, type, metavar, help)
_VERIFY_FLAGS: tuple[tuple[str, str, type, str, str], ...] = (
    ("--verify-window", "window", float, "SECONDS", "length of each window (default 30)"),
    ("--verify-settle", "settle", float, "SECONDS",
     "leading seconds of each window whose arrivals are not counted: the previous window's requests "
     "still run then (default 5)"),
    ("--verify-min-pairs", "min_pairs", int, "N", "window pairs before any decision (default 3)"),
    ("--verify-max-pairs", "max_pairs", int, "N", "window pairs after which a decision is forced (default 20)"),
    ("--verify-min-gain", "min_gain", float, "FRACTION",
     "at --verify-max-pairs without a significant result, keep the policy only if its measured gain is at "
     "least this (default 0.02)"),
    ("--verify-level", "level", float, "F", "confidence of the verdict over all looks together (default 0.95)"),
    ("--verify-min-requests", "min_requests", int, "N",
     "counted requests a window needs for its pair to count (default 20)"),
)


#: the service group's numeric knobs: (flag, type, metavar, help); every default lives in SidecarConfig
_SERVICE_NUMBERS: tuple[tuple[str, type, str, str], ...] = (
    ("--policy-max-bytes", int, "N", "largest policy file or download read (default 64 MiB)"),
    ("--policy-max-array-bytes", int, "N", "largest inflated member of a policy archive (default 128 MiB)"),
    ("--policy-max-inflated-bytes", int, "N", "all members of a policy archive together, inflated (default 192 MiB)"),
    ("--policy-load-timeout", float, "SECONDS", "deadline of a policy load off the event loop (default 10)"),
    ("--watch-interval", float, "SECONDS", "seconds between checks of the --policy file (default 1)"),
    ("--status-interval", float, "SECONDS",
     "seconds between scrapes of Apache's mod_status (default 5; never per /-/metrics request)"),
    ("--drain-timeout", float, "SECONDS", "SIGTERM: seconds to let accepted requests finish before exiting (default 30)"),
)


def register(subparsers: Any) -> None:
    """Add the ``sidecar`` sub-command."""
    p = subparsers.add_parser(
        "sidecar",
        help="reverse proxy that releases requests to Apache exactly when the policy starts a thread "
        "(or, in module mode, the controller beside Apache)",
        description="Hold each request in its stage queue and release it to Apache when the policy "
        "says a thread should start (van der Weij et al. §4.2); with --enforce module, mod_overtake_prio "
        "holds them inside Apache and this process only writes its count table, refits and reports. "
        "Metrics at /-/metrics, policy at /-/policy "
        "(PUT with the admin token to hot-swap), both on the admin listener. Options may come from "
        "--config FILE (YAML, keys as the flags with _ for -); a flag given overrides the file.",
    )
    _policy_flags(p)
    _uplink_flags(p)
    p.add_argument("--loop", choices=["uvloop", "asyncio"], default=None, help="event loop (default uvloop)")
    _apache_flags(p)
    _service_flags(p)
    _online_flags(p)


def _policy_flags(p: argparse.ArgumentParser) -> None:
    """The config file, the policy, Apache, the listener and the stages."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML config file (apache-conf/examples/sidecar.yaml); flags override its keys")
    p.add_argument("--policy", default=None,
                   help='policy file from `overtake solve --out`, "pi(k)", "pi(k1,k2)" or passthrough '
                   "(with --policy-url: the fallback while the API is unreachable at start)")
    p.add_argument("--policy-url", default=None, metavar="URL",
                   help="take the policy from `overtake api`: http://HOST:PORT/v1/models/ID/policy.npz "
                   "(or .../models/ID); polled with its ETag, hot-swapped when the model changes")
    p.add_argument("--policy-poll", type=float, default=None, metavar="SECONDS",
                   help="seconds between polls of --policy-url (default 10)")
    p.add_argument("--policy-token", default=None, metavar="TOKEN",
                   help="bearer token sent with --policy-url requests")
    p.add_argument("--apache", default=None, help="Apache base URL, e.g. http://127.0.0.1:8081 (required here or in --config)")
    p.add_argument("--listen", default=None, help="HOST:PORT to listen on, e.g. 127.0.0.1:8080 (required here or in --config, "
                   "except with --enforce module, where nothing listens)")
    p.add_argument("--stages", default=None, help="stages YAML (see examples/sidecar/stages.yaml; required here or in --config)")
    p.add_argument("--phase-header", default=None,
                   help="request header carrying the phase (explicit mode); overrides the stages file")


def _uplink_flags(p: argparse.ArgumentParser) -> None:
    """How response bytes leave (controller.uplink)."""
    p.add_argument("--uplink", default=None, help="uplink scheduler for responses (controller.uplink; default fair)")
    p.add_argument("--uplink-cutoffs", default=None, metavar="LIST",
                   help="fixed SRPT band cutoffs in bytes ('1K,4K,16K,64K'; SRRT: seconds); default adaptive")
    p.add_argument("--uplink-top-fraction", type=float, default=None, metavar="F",
                   help=f"adaptive cutoffs: share of responses above the highest cutoff (default "
                        f"{TOP_FRACTION:g}, the low end of Harchol-Balter et al.'s 0.005-0.01; 0.001 suits "
                        "World Cup 98 sizes better)")
    p.add_argument("--uplink-lowest-writers", type=int, default=None, metavar="K",
                   help="srpt/srrt: at most K responses of the lowest band write at once, least "
                   "remaining first (SRPT inside that band); 0 = one FIFO (default)")
    p.add_argument("--uplink-ordered-bands", type=int, default=None, metavar="N",
                   help="with --uplink-lowest-writers: order each of the lowest N bands so "
                   "(default 1, the lowest only)")


def _apache_flags(p: argparse.ArgumentParser) -> None:
    """What mod_overtake_prio and the PHP extension do inside Apache."""
    p.add_argument("--cpu-priority", choices=["off", "auto", "age", "class"], default=None,
                   help="the CPU priority of mod_overtake_prio in Apache: age (Apache demotes by attained "
                   "CPU; the sidecar exports its counters), class (also sets X-Overtake-Class: 0 for requests "
                   "whose phase or route is expected shorter than the stage's mean, or whose size predicted from "
                   "the route key is not among the stage's largest, 1 otherwise), auto (class where a stage "
                   "predicts sizes from a route key, else age with --control-file, else off; the choice and its "
                   "reason are logged and in /-/policy), off (default)")
    p.add_argument("--gate", default=None, metavar="PATH",
                   help="admission gate inside Apache (mod_overtake_prio's OvertakeGate PATH, e.g. /dev/shm/overtake-gate): "
                   "queued requests go to Apache at once and wait there on a futex until admitted, so an admission "
                   "costs a wake-up instead of a request hand-over; off when Apache does not report the same file. "
                   "The headers are signed with the key in PATH.key (created by whichever of Apache and the sidecar "
                   "starts first)")
    p.add_argument("--gate-slots", type=int, default=None, metavar="N",
                   help="requests the gate may hold in Apache at once (default 64); each holds a worker, so keep "
                   "MaxRequestWorkers >= limits.max_inflight + N")
    p.add_argument("--gate-backfill", type=int, default=None, metavar="N",
                   help="start the N oldest requests held in the gate early at SCHED_IDLE, so Apache's core "
                   "never idles while they wait (needs an 'idle' level in OvertakePrioNice; default 1, 0 = off)")
    p.add_argument("--php-stats-file", default=None, metavar="PATH",
                   help="the counters of the overtake_prio PHP extension (its overtake_prio.stats_file), exported "
                   "as overtake_php_* metrics: demotions inside PHP-FPM's workers, where mod_overtake_prio "
                   "cannot reach")
    p.add_argument("--fpm-pool-config", default=None, metavar="PATH",
                   help="the PHP-FPM pool file Apache forwards the stages to (e.g. /etc/php/8.2/fpm/pool.d/www.conf): "
                   "its pm.max_children is checked against the policy's total cap at start and at every swap "
                   "(a warning when the pool is smaller: the rest would queue in FPM, out of the policy's order)")
    p.add_argument("--control-file", default=None, metavar="PATH",
                   help="write the age thresholds of the policy in force to PATH whenever the policy changes "
                   "(start, refit, PUT), for mod_overtake_prio's OvertakeControlFile PATH "
                   "(e.g. /dev/shm/overtake-control): Apache applies them without a config edit or restart. "
                   "Signed with the key in PATH.key (created by whichever side starts first)")
    p.add_argument("--enforce", choices=["sidecar", "module"], default=None,
                   help="where the policy is enforced: sidecar (default: requests pass through this proxy, "
                   "needed for phase headers, route classes and uplink SRPT) or module (mod_overtake_prio holds "
                   "the requests of its OvertakeStage sections by the policy's count table, written to "
                   "--control-file; no request passes through the sidecar, which refits and exports the metrics "
                   "beside Apache; a blind policy only)")


def _service_flags(p: argparse.ArgumentParser) -> None:
    """Running as a service: control endpoints, limits, logs, shutdown."""
    s = p.add_argument_group("service", "running as a service: control endpoints, limits, logs, shutdown")
    s.add_argument("--admin-listen", default=None, metavar="HOST:PORT",
                   help="the admin listener: /-/metrics (and /metrics), /-/policy, /-/healthz, /-/livez "
                   "(default 127.0.0.1:9089; the public listener answers only /-/healthz and /-/livez)")
    s.add_argument("--admin-token-file", default=None, metavar="PATH",
                   help="file holding the bearer token PUT /-/policy must carry (without one, writes are refused)")
    s.add_argument("--trusted-source", action="append", default=None, dest="trusted_sources", metavar="CIDR",
                   help="client network whose X-Overtake-Phase/-Next-Phase/-Class headers are honoured (repeatable; "
                   "default loopback); from others they are stripped")
    s.add_argument("--admin-policy-url", action="append", default=None, dest="admin_policy_urls", metavar="PREFIX",
                   help="URL prefix PUT /-/policy may follow besides --policy-url's origin (repeatable)")
    for flag, kind, metavar, text in _SERVICE_NUMBERS:
        s.add_argument(flag, type=kind, default=None, metavar=metavar, help=text)
    s.add_argument("--request-log", default=None, metavar="PATH",
                   help="access log, one line per request with stage, phase, queue wait, upstream time (- = stdout)")
    s.add_argument("--request-log-format", choices=["json", "combined"], default=None,
                   help="json (default) or Apache combined plus stage=, phase=, queue_wait=, upstream=")


def _online_flags(p: argparse.ArgumentParser) -> None:
    """The online refit loop (controller.online)."""
    o = p.add_argument_group("online loop", "measure demands and arrivals, refit the PH model, re-solve pi* in a "
                             "worker process and hot-swap it when predicted better (controller.online)")
    o.add_argument("--online", action="store_true", default=None, help="enable the online refit loop")
    o.add_argument("--refit-interval", type=float, default=None, metavar="SECONDS",
                   help="at most one refit per interval (default 60)")
    o.add_argument("--min-samples", type=int, default=None, metavar="N",
                   help="demand samples per stage before a refit is tried (default 200)")
    o.add_argument("--arrival-window", type=float, default=None, metavar="SECONDS",
                   help="window of the arrival-rate estimate (default 60)")
    o.add_argument("--access-log", default=None, metavar="PATH",
                   help="Apache access log (overtake apache's WORKDIR/logs/access.log): take service demands "
                   "from its cpu_us notes instead of the attained service under sharing")
    o.add_argument("--swap-margin", type=float, default=None, metavar="FRACTION",
                   help="swap only when the new policy's predicted E[W] is lower by more than this (default 0.01)")
    o.add_argument("--refit-tolerance", type=float, default=None, metavar="FRACTION",
                   help="relative accuracy of the re-solve (default 0.01)")
    v = p.add_argument_group("live verification", "run the policy against Apache's default (forward at once, no "
                             "CPU demotion) in alternating windows of random order, and fall back to the default "
                             "unless the policy's mean response time is measured lower (controller.sidecar.verify)")
    v.add_argument("--verify", action="store_true", default=None, help="enable the live verification (default off)")
    for flag, key, kind, metavar, text in _VERIFY_FLAGS:
        v.add_argument(flag, dest=f"verify_{key}", type=kind, default=None, metavar=metavar, help=text)


async def _main(side: Sidecar) -> None:
    """Serve until SIGTERM/SIGINT, then drain (a second signal cuts the drain short); SIGHUP reloads."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0

    def on_stop() -> None:
        nonlocal signals
        signals += 1
        stop.set()
        if signals > 1 and drain is not None:
            drain.cancel()

    drain: asyncio.Task[int] | None = None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop)  # graceful shutdown, exit code 0
    loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(side.reload()))
    await side.start()
    try:
        await stop.wait()
        drain = asyncio.ensure_future(side.drain())
        try:
            await drain
        except asyncio.CancelledError:
            if not drain.cancelled():
                raise
            log.warning("drain cut short by a second signal", extra={"event": "drained"})
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        await side.close()


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line, as config keys (online flags under ``online``)."""
    from overtake.controller.sidecar.config import SidecarConfig

    given = {k: v for k, v in vars(args).items() if v is not None and k in SidecarConfig.model_fields}
    online = {k: v for k, v in vars(args).items() if v is not None and k in _ONLINE_FLAGS}
    if getattr(args, "online", None):
        online["enabled"] = True
    elif online and args.config is None:
        online = {}  # without --online (or online: in the file) these flags do nothing, as before
    given.pop("online", None)
    if online:
        given["online"] = online
    verify = {key: getattr(args, f"verify_{key}") for _, key, *_ in _VERIFY_FLAGS
              if getattr(args, f"verify_{key}", None) is not None}
    if getattr(args, "verify", None):
        verify["enabled"] = True
    given.pop("verify", None)
    if verify:
        given["verify"] = verify
    return given


def options_from_args(args: argparse.Namespace) -> tuple[SidecarConfig, SidecarOptions]:
    """The validated config (file + flags) and the sidecar's options."""
    from overtake.controller.sidecar.config import load_config, to_options

    cfg = load_config(args.config, _overrides(args))
    return cfg, to_options(cfg)


def run(args: argparse.Namespace) -> int:
    """Build the sidecar from the config file and the flags, and serve until SIGTERM."""
    if args.config is None and args.policy is None and args.policy_url is None:
        raise SidecarInputError("policy: give --policy FILE|pi(k)|passthrough or --policy-url URL")
    # the sidecar's imports only once the options have parsed
    from overtake.controller.sidecar.config import load_config
    from overtake.controller.sidecar.logs import configure_logging
    from overtake.controller.sidecar.service import Sidecar
    from overtake.controller.sidecar.stages import load_stages

    cfg, opts = options_from_args(args)
    table = load_stages(cfg.stages)

    def reload_options() -> SidecarOptions:
        return options_from_args(args)[1]

    def reload_stages() -> StageTable:
        # the config may name another stages file now; its content is what a reload applies
        return load_stages(load_config(args.config, _overrides(args)).stages if args.config else cfg.stages)

    configure_logging()

    async def main() -> None:
        side = Sidecar(table, opts, reload_options=reload_options if args.config else None,
                       reload_stages=reload_stages)
        await _main(side)

    if cfg.loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    return 0
