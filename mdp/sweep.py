"""Parameter sweeps: expand a grid of scenarios and solve every point on Dask (``overtake sweep``).

A grid file is a base scenario (the schema of ``overtake solve``, :mod:`overtake.mdp.scenario`) and axes::

    base: {stages: [{name: stage1, service: {...}}, ...], tolerance: 0.01}
    grid:
      load: [0.3, 0.5, 0.7]
      cores: [1, 2]
      overhead: [0.0]
      stage2.mean: [1.0, 5.0]     # a stage's service mean ...
      stage2.scv: [1.0, 5.0]      # ... and squared coefficient of variation
    policies: ["pi(2)"]           # baselines besides compare's defaults (optional)

Every combination is a point. A stage given by ``mean``/``scv`` gets the two-moment PH of Tijms (1994,
§A.2; :func:`overtake.fitting.match_two_moments`: balanced-means H2 for scv > 1, exponential, mixed Erlang
below 1 — the parametrisation of Table 1); an axis that gives only one of the two keeps
the other from the base service. Each point runs :func:`overtake.mdp.comparison.compare` (π* and the
baselines) as one Dask task; the result is one long table, a row per (point, policy).
"""

from __future__ import annotations

import copy
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .baselines import Baseline
from .comparison import compare
from .errors import ModelError
from .scenario import parse_scenario
from .statespace import Truncation, count_states

Progress = Callable[[str], None]

_SCALAR_AXES = ("load", "arrival_rate", "cores", "overhead")
_STAGE_KEYS = ("mean", "scv")
#: Thread pools of numerical libraries in every worker: one task = one core.
WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


@dataclass(frozen=True)
class SweepPoint:
    """One grid point: its index, the axis values and the resolved scenario mapping."""

    index: int
    params: dict[str, float]
    scenario: dict[str, Any]
    policies: tuple[str, ...]


def _stage_moments(service: dict[str, Any], where: str) -> tuple[float, float]:
    from .scenario import parse_service

    try:
        a, T = parse_service(service).representation()
    except Exception as exc:  # pydantic's error, re-raised as one line below
        raise ModelError(f"{where}: invalid service ({str(exc).splitlines()[0]})") from None
    u = np.linalg.solve(-np.asarray(T), np.ones(len(a)))
    m1 = float(a @ u)
    m2 = float(2.0 * a @ np.linalg.solve(-np.asarray(T), u))
    return m1, m2 / (m1 * m1) - 1.0


def _ph_service(mean: float, scv: float, where: str) -> dict[str, Any]:
    from overtake.fitting import match_two_moments

    if not (np.isfinite(mean) and mean > 0):
        raise ModelError(f"{where}.mean must be > 0, got {mean!r}")
    if not (np.isfinite(scv) and scv > 0):
        raise ModelError(f"{where}.scv must be > 0, got {scv!r}")
    if scv < 0.1:
        raise ModelError(f"{where}.scv = {scv:g} needs more than 10 Erlang phases; use scv >= 0.1")
    ph = match_two_moments(mean, scv)
    return {"ph": {"alpha": np.asarray(ph.alpha).tolist(), "T": np.asarray(ph.T).tolist()}}


def parse_grid(doc: Any) -> list[SweepPoint]:
    """Validate a grid document and expand it into points; errors name the field (one line)."""
    base, axes = _grid_parts(doc)
    names = _stage_names(base)
    values = _axis_values(axes, names)
    policies = _grid_policies(doc, len(names))
    keys = list(values)
    points = []
    for idx, combo in enumerate(itertools.product(*(values[k] for k in keys))):
        params = dict(zip(keys, combo))
        sc = _point_scenario(base, names, params)
        try:
            parse_scenario(sc).build_model()
        except ModelError as exc:
            desc = ", ".join(f"{k}={v:g}" for k, v in params.items())
            raise ModelError(f"grid point {idx} ({desc}): {exc}") from None
        points.append(SweepPoint(idx, params, sc, tuple(policies)))
    return points


def _grid_parts(doc: Any) -> tuple[dict[str, Any], dict[Any, Any]]:
    """The grid document's ``base`` scenario and ``grid`` axes, its keys checked."""
    if not isinstance(doc, dict):
        raise ModelError(f"grid file must be a mapping with base and grid, got {type(doc).__name__}")
    unknown = sorted(set(doc) - {"base", "grid", "policies"})
    if unknown:
        raise ModelError(f"{unknown[0]}: unknown key; a grid file has base, grid and policies")
    base = doc.get("base")
    if not isinstance(base, dict):
        raise ModelError("base: required: the scenario the axes modify (stages, optional tolerance, cores, ...)")
    axes = doc.get("grid")
    if not isinstance(axes, dict) or not axes:
        raise ModelError("grid: required: a mapping of axis -> list of values, e.g. grid: {load: [0.3, 0.6]}")
    return base, axes


def _stage_names(base: dict[str, Any]) -> list[str]:
    """The base scenario's stage names: the ``STAGE.mean`` / ``STAGE.scv`` axes refer to them."""
    stages = base.get("stages")
    if not isinstance(stages, list) or not stages or not all(isinstance(s, dict) and "name" in s for s in stages):
        raise ModelError("base.stages: required: a list of {name, service}")
    return [str(s["name"]) for s in stages]


def _axis_values(axes: dict[Any, Any], names: list[str]) -> dict[str, list[float]]:
    """Each axis's values as floats (a lone number is a one-value axis); unknown axes, non-numbers
    and load beside arrival_rate (two ways to set one rate) refused."""
    values: dict[str, list[float]] = {}
    for key, vals in axes.items():
        key = str(key)
        stage, dot, what = key.rpartition(".")
        ok = key in _SCALAR_AXES or (dot and stage in names and what in _STAGE_KEYS)
        if not ok:
            raise ModelError(
                f"grid.{key}: unknown axis; use load, arrival_rate, cores, overhead or STAGE.mean / STAGE.scv "
                f"with STAGE one of {', '.join(names)}"
            )
        if not isinstance(vals, list) or not vals:
            vals = [vals] if isinstance(vals, (int, float)) and not isinstance(vals, bool) else None
        if vals is None or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            raise ModelError(f"grid.{key}: give a non-empty list of numbers, e.g. {key}: [1, 2]")
        values[key] = [float(v) for v in vals]
    if "load" in values and "arrival_rate" in values:
        raise ModelError("grid: give load or arrival_rate as an axis, not both")
    return values


def _grid_policies(doc: dict[str, Any], n_stages: int) -> list[str]:
    """The baselines compared at every point, each name checked against the stage count."""
    policies = doc.get("policies", [])
    if not isinstance(policies, list) or not all(isinstance(p, str) for p in policies):
        raise ModelError('policies: give a list of baseline names, e.g. ["pi(2)", "pi(1,2)"]')
    for p in policies:
        Baseline.parse(p, n_stages)
    return policies


def _point_scenario(base: dict[str, Any], names: list[str], params: dict[str, float]) -> dict[str, Any]:
    """The base scenario with one point's axis values in place (a copy: the base serves every point)."""
    sc = copy.deepcopy(base)
    if "load" in params:
        sc.pop("arrival_rate", None)
        sc["load"] = params["load"]
    if "arrival_rate" in params:
        sc.pop("load", None)
        sc["arrival_rate"] = params["arrival_rate"]
    if "cores" in params:
        if params["cores"] != int(params["cores"]):
            raise ModelError(f"grid.cores: values must be whole numbers, got {params['cores']:g}")
        sc["cores"] = int(params["cores"])
    if "overhead" in params:
        sc["overhead"] = params["overhead"]
    for i, name in enumerate(names):
        if f"{name}.mean" in params or f"{name}.scv" in params:
            sc["stages"][i] = {"name": name, "service": _point_service(sc["stages"][i], i, name, params)}
    return sc


def _point_service(stage: dict[str, Any], i: int, name: str, params: dict[str, float]) -> dict[str, Any]:
    """Stage ``i``'s service at a point that moves its mean or SCV: a PH with the point's moments,
    the one not on an axis taken from the base stage's service."""
    mk, sk = f"{name}.mean", f"{name}.scv"
    if mk in params and sk in params:
        mean, scv = params[mk], params[sk]
    else:
        svc = stage.get("service")
        if svc is None:
            raise ModelError(f"base.stages.{i}.service: required unless the grid gives both {mk} and {sk}")
        m0, s0 = _stage_moments(svc, f"base.stages.{i}.service")
        mean, scv = params.get(mk, m0), params.get(sk, s0)
    return _ph_service(mean, scv, f"grid.{name}")


def solve_point(point: SweepPoint) -> list[dict[str, Any]]:
    """π* and the baselines at one point (:func:`overtake.mdp.comparison.compare`): one row per policy."""
    t0, c0 = time.perf_counter(), time.process_time()
    sc = parse_scenario(point.scenario)
    model = sc.build_model()
    base = {"point": point.index, **point.params, "arrival_rate": model.arrival_rate,
            "load_value": model.arrival_rate * model.mean_service()}
    try:
        doc = compare(model, policies=point.policies, tol=sc.tolerance, truncation=sc.fixed_truncation())
    except Exception as exc:  # a point that fails (e.g. load too close to 1) must not sink the sweep
        return [{**base, "policy": None, "error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}]
    rows = []
    for name, m in doc["policies"].items():
        rows.append({
            **base, "policy": name, "mean_response_time": m["mean_response_time"],
            "mean_in_system": m["mean_in_system"], "mean_threads": m["mean_threads"],
            "blocking_probability": m["blocking_probability"], "gain": doc["gains"].get(name, 0.0),
            "states": doc["states"], "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0, "error": None,
        })
    return rows


def estimated_states(point: SweepPoint) -> int:
    """State count of π*'s MDP at the point's fixed truncation (or the auto-truncation's start)."""
    sc = parse_scenario(point.scenario)
    model = sc.build_model()
    tr = sc.fixed_truncation() or Truncation(10, min(3 + model.cores - 1, 10))
    return count_states(model, tr)


def local_cluster(workers: int):  # type: ignore[no-untyped-def]
    """A LocalCluster of single-threaded worker processes with WORKER_ENV (one BLAS/numba thread)."""
    import dask
    from dask.distributed import LocalCluster

    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    env.update(WORKER_ENV)
    with dask.config.set({"distributed.nanny.pre-spawn-environ": env}):
        return LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                            dashboard_address=None, silence_logs=50)


def run_sweep(
    points: Sequence[SweepPoint],
    *,
    scheduler: str | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    client: Any = None,
) -> Any:
    """Solve every point on Dask; returns a pandas DataFrame (a row per point and policy).

    ``scheduler`` (``tcp://host:8786``) uses a running cluster whose workers have overtake
    installed; otherwise a LocalCluster of ``workers`` single-threaded processes (default: CPUs).
    An existing ``client`` is used as is and left open.
    """
    import pandas as pd
    from dask.distributed import Client, as_completed

    t0 = time.perf_counter()
    cluster = None
    own = client is None
    if client is None and scheduler:
        client = Client(scheduler, timeout="20s")
    elif client is None:
        cluster = local_cluster(workers or os.cpu_count() or 1)
        client = Client(cluster)
    try:
        # largest first (longest-processing-time order), so no big point is left alone at the end
        ordered = sorted(points, key=estimated_states, reverse=True)
        futures = client.map(solve_point, ordered, pure=False)
        rows: list[dict[str, Any]] = []
        done = 0
        for fut in as_completed(futures):
            rows.extend(fut.result())
            done += 1
            if progress:
                progress(f"sweep: {done}/{len(futures)} points ({time.perf_counter() - t0:.1f} s)")
    finally:
        if own:
            client.close()
        if cluster is not None:
            cluster.close()
    df = pd.DataFrame(rows)
    return df.sort_values(["point", "policy"], kind="stable", na_position="first").reset_index(drop=True)


def write_table(df: Any, path: str) -> None:
    """CSV or Parquet by the file name's extension."""
    low = str(path).lower()
    if low.endswith(".csv"):
        df.to_csv(path, index=False)
    elif low.endswith(".parquet") or low.endswith(".pq"):
        df.to_parquet(path, index=False)
    else:
        raise ModelError(f"--out {path}: use a .csv or .parquet file name")


def plot_gains(df: Any, path: str) -> None:
    """Gain of π* over each baseline vs load, one panel per combination of the other axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = df[df["error"].isna() & (df["policy"] != "pi*")]
    axes_cols = [c for c in df.columns if c in _SCALAR_AXES or c.endswith(".mean") or c.endswith(".scv")]
    other = [c for c in axes_cols if c not in ("load", "arrival_rate")]
    groups = list(ok.groupby(other)) if other else [((), ok)]
    n = len(groups)
    cols = min(3, n)
    rows = int(np.ceil(n / cols))
    fig, axs = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (key, g) in zip(axs.ravel(), groups):
        for pol, gp in g.groupby("policy"):
            gp = gp.sort_values("load_value")
            ax.plot(gp["load_value"], 100 * gp["gain"], marker="o", label=pol)
        key = key if isinstance(key, tuple) else (key,)
        ax.set_title(", ".join(f"{c}={v:g}" for c, v in zip(other, key)) or "all points", fontsize=9)
        ax.set_xlabel("load ρ")
        ax.set_ylabel("gain of π* (%)")
        ax.grid(alpha=0.3)
    for ax in axs.ravel()[n:]:
        ax.axis("off")
    axs.ravel()[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
