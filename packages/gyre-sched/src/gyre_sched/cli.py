"""`gyre-sched simulate CONFIG`, `gyre-sched compare CONFIG` (TOML or JSON; `preset = "nl2repo"` as a base),
`gyre-sched predict TRACE` (the simulator's prediction of a recorded run, calibrated from its own trace) and
`gyre-sched workload --preset X` (the workload's statistics beside the paper's), `gyre-sched plan` (sweep the knobs
and recommend settings) and `gyre-sched calibrate RUN...` (the cost model fitted to real runs, with its error)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gyre_sched.config import SimConfig, load_config_dict
from gyre_sched.presets import compare_configs, deep_merge, resolve
from gyre_sched.sim import SimResult, Simulator
from gyre_sched.trace import read_trace


def _set(raw: dict[str, Any], assignment: str) -> dict[str, Any]:
    """--set policy.mu=4 (value parsed as JSON, else kept as a string)."""
    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise ValueError(f"--set expects KEY=VALUE, got {assignment!r}")
    try:
        val: Any = json.loads(value)
    except json.JSONDecodeError:
        val = value
    for part in reversed(key.split(".")):
        val = {part: val}
    return deep_merge(raw, val)


def _load(args: argparse.Namespace) -> dict[str, Any]:
    raw = load_config_dict(args.config) if args.config != "-" else {}
    if args.preset:
        raw = {"preset": args.preset, **raw}
    for a in args.set or []:
        raw = _set(raw, a)
    return raw


def run_one(cfg: SimConfig, out: Path | None, *, plots: bool = True) -> SimResult:
    """Simulate one config; with ``out``: config.json first, then trace.jsonl, summary.json, bursts.jsonl (one
    `gyre_sched.diagnostics.Burst` a line) and the PNGs."""
    if out is None:
        return Simulator(cfg).run()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    with (out / "trace.jsonl").open("wb") as fh:
        res = Simulator(cfg, trace_stream=fh).run()
    (out / "summary.json").write_text(json.dumps(res.summary(), indent=2))
    (out / "bursts.jsonl").write_text("".join(json.dumps(b) + "\n" for b in res.bursts))
    if plots:
        from gyre_sched.plots import role_timeline_png, waterlevel_png

        s = read_trace(out / "trace.jsonl", validate=False)
        role_timeline_png(s, out / "roles.png", f"{cfg.name}: cell roles")
        waterlevel_png(s, out / "waterlevel.png", f"{cfg.name}: waterlevel vs capacity")
    return res


def _print_result(r: SimResult) -> None:
    shares = ", ".join(f"{k} {v:.1%}" for k, v in r.role_share.items())
    print(f"policy              {r.policy}")
    print(f"end-to-end time     {r.end_time_s / 3600:.2f} h ({r.end_time_s:.0f} s)")
    print(f"steps               {r.steps}")
    print(f"staleness mean      {r.mean_staleness:.3f} (steady, no refills: {r.mean_staleness_steady:.3f})")
    print(f"staleness max       {r.max_staleness}")
    print(f"time share per role {shares}")
    use, basis = r.time_use, r.cost_basis
    print(
        f"training            {basis['train_node_s_per_group']:.0f} node-s a group ({basis['model']}, "
        f"{basis['attention_share']:.0%} of it attention); train slack {use['train_slack']:.3f}, "
        f"exposed {use['exposed_training_share']:.1%} of the run"
    )
    print(f"counters            {r.counters}")


def cmd_simulate(args: argparse.Namespace) -> int:
    raw = resolve(_load(args))
    raw.pop("compare", None)  # one file serves both commands
    cfg = SimConfig.model_validate(raw)
    out = Path(args.out) if args.out else Path("sched-out") / cfg.name
    res = run_one(cfg, out, plots=not args.no_plots)
    _print_result(res)
    print(
        f"wrote {out}/config.json, trace.jsonl, summary.json, bursts.jsonl"
        + ("" if args.no_plots else ", roles.png, waterlevel.png")
    )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    cmp, cfgs = compare_configs(_load(args))
    base_out = Path(args.out) if args.out else Path("sched-out") / "compare"
    base_out.mkdir(parents=True, exist_ok=True)
    (base_out / "config.json").write_text(
        json.dumps(
            {"compare": cmp.model_dump(), "runs": {k: c.model_dump() for k, c in cfgs.items()}}, indent=2
        )
    )
    results = {k: run_one(c, base_out / k, plots=not args.no_plots) for k, c in cfgs.items()}
    ref = results.get("elastic") or next(iter(results.values()))
    print(
        f"{'policy':<10} {'phi':>5} {'mu':>3} {'E[d]':>5} {'time h':>8} {'steps':>5} {'d mean':>7} {'d max':>5} "
        f"{'train%':>7} {'speedup of ' + ref.policy:>20}"
    )
    rows = []
    for k, r in results.items():
        p = cfgs[k].policy
        sp = r.end_time_s / ref.end_time_s
        print(
            f"{k:<10} {p.phi:>5.2f} {p.mu:>3} {p.phi + (p.mu - 1) / 2:>5.2f} {r.end_time_s / 3600:>8.2f} "
            f"{r.steps:>5} {r.mean_staleness:>7.3f} {r.max_staleness:>5} {r.role_share['training']:>7.1%} {sp:>19.2f}x"
        )
        rows.append({"policy": k, "phi": p.phi, "mu": p.mu, "time_s": r.end_time_s, "speedup_of_ref": sp})
    (base_out / "compare.json").write_text(json.dumps(rows, indent=2))
    print(f"wrote {base_out}/")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from gyre_sched.replay import predict

    overrides: dict[str, Any] = {}
    for a in args.set or []:
        overrides.update(_set({}, a))
    pred = predict(args.trace, overrides=overrides or None)
    print(pred.model_dump_json(exclude=set() if args.full else {"sim_config"}))
    return 0


def cmd_workload(args: argparse.Namespace) -> int:
    from gyre_sched.workfit import PRESET_FITS, TARGETS_122B, Fit, fit_workload, format_rows, workload_stats

    raw = resolve(_load(args))
    raw.pop("compare", None)
    cfg = SimConfig.model_validate(raw)
    targets, free = PRESET_FITS.get(args.preset or "", (TARGETS_122B, []))
    N = cfg.policy.N
    if args.fit:
        if not free:
            raise ValueError("--fit needs --preset with a known fit (" + ", ".join(PRESET_FITS) + ")")
        fit = fit_workload(cfg.workload, targets, free, N=N, queries=args.queries)
        wl = fit.workload
        print(
            "fitted: "
            + ", ".join(f"{k} = {getattr(wl, k):.6g}" for k in free)
            + f" ({fit.evaluations} evaluations)"
        )
    else:
        wl = cfg.workload
    stats = workload_stats(wl, N=N, queries=args.queries, seed=args.seed)
    fit = Fit(wl, stats, targets, 0.0, 0)
    rows = fit.rows()
    worst = max(abs(r["miss"]) / r["tolerance"] for r in rows)
    w = wl
    print(f"workload of {cfg.name}: {args.queries} queries x N={N} executions, seed {args.seed}")
    print(
        f"exclusion: {w.exclusion}"
        + (f" (hang-prone queries {w.hang_query_rate:.3%})" if w.exclusion == "per_query" else "")
        + f", overall timeouts {w.overall_timeout_rate:.3%} of executions, known at the "
        + ("overall budget" if w.exclusion_known == "budget" else f"stall + {w.stall_detect_s:.0f} s")
    )
    for line in format_rows(rows):
        print(line)
    others = {k: round(v, 5) for k, v in stats.items() if k not in targets}
    print("not targeted: " + ", ".join(f"{k} {v}" for k, v in others.items()))
    print(
        json.dumps(
            {
                "workload": cfg.name,
                "stats": stats,
                "targets": targets,
                "worst_in_tolerances": worst,
                "parameters": wl.model_dump(exclude={"trace"}),
            }
        )
    )
    return 0 if worst <= 1.0 else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from gyre_sched.plan import plan

    raw = resolve(_load(args))
    raw.pop("compare", None)
    if args.trace:
        raw = deep_merge(raw, {"workload": {"trace": args.trace}})
    if args.steps:
        raw["steps"] = args.steps
    cfg = SimConfig.model_validate(raw)
    out = Path(args.out) if args.out else Path("sched-out") / f"{cfg.name}-plan"
    summary = plan(cfg, args.staleness, tolerance=args.tolerance, out=out, log=print)
    for t, b in summary["best"].items():
        rec = b["recommended"]
        print(
            f"recommended at E[d]={t}: {b['label']}: {rec['time_h']:.2f} h, realized staleness "
            f"{rec['staleness']:.3f} (steady {rec['staleness_steady']:.3f}); ideal bound {b['bound_h']:.2f} h "
            f"({b['over_bound']:.3f}x), capacity bound {b['capacity_bound_h']:.2f} h "
            f"({b['over_capacity_bound']:.3f}x), dispatch-order reference {b['dispatch_order_h']:.2f} h "
            f"({b['over_dispatch_order']:.3f}x)"
        )
    print(f"wrote {out}/plan.json, plan.png")
    print(
        json.dumps(
            {
                t: {
                    "label": b["label"],
                    "time_h": round(b["recommended"]["time_h"], 3),
                    "staleness": round(b["recommended"]["staleness"], 4),
                    "bound_h": round(b["bound_h"], 3),
                    "capacity_bound_h": round(b["capacity_bound_h"], 3),
                    "dispatch_order_h": round(b["dispatch_order_h"], 3),
                }
                for t, b in summary["best"].items()
            }
        )
    )
    return 0 if len(summary["best"]) == len(args.staleness) else 1


def cmd_calibrate(args: argparse.Namespace) -> int:
    from gyre_sched.costfit import fit_costs

    fit = fit_costs(args.runs)
    print(
        f"micro-step: {fit.overhead_s:.4g} s (+- {fit.overhead_se:.2g}) + {fit.s_per_token:.4g} s/token "
        f"(+- {fit.s_per_token_se:.2g}); relative RMS error over samples {fit.microstep_rel_rmse:.1%}"
    )
    print(f"{'cost':<22} {'fitted s':>10} {'samples':>8} {'rel. RMS':>9}")
    for name, c in fit.costs.items():
        print(f"{name:<22} {c['fitted']:>10.4g} {c['samples']:>8} {c['rel_rmse']:>9.1%}")
    print(f"{'run':<24} {'policy':<9} {'recorded s':>10} {'simulated s':>11} {'error':>7}")
    for r in fit.runs:
        print(
            f"{r['run']:<24} {r['policy']:<9} {r['recorded_s']:>10.2f} {r['simulated_s']:>11.2f} "
            f"{r['relative_error']:>7.1%}"
        )
    for n in fit.notes:
        print(f"note: {n}")
    print(json.dumps(fit.summary()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gyre-sched", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn, help_ in (
        ("simulate", cmd_simulate, "simulate one policy and write config, trace and plots"),
        (
            "compare",
            cmd_compare,
            "Elastic vs Async vs Colocate at matched E[d] on the same workload and seed",
        ),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("config", help="TOML or JSON config file ('-' for none: use --preset/--set only)")
        p.add_argument("--preset", help="base preset (e.g. nl2repo); the config file overrides it")
        p.add_argument(
            "--set", action="append", metavar="KEY=VALUE", help="override, e.g. policy.mu=4 (repeatable)"
        )
        p.add_argument("--out", help="output directory (default sched-out/NAME)")
        p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
        p.set_defaults(fn=fn)
    p = sub.add_parser(
        "predict",
        help="predict a recorded run's wall time: costs calibrated from its trace, same policy (one JSON line)",
    )
    p.add_argument("trace", help="trace.jsonl of a real or simulated run")
    p.add_argument(
        "--set",
        action="append",
        metavar="PARAM=VALUE",
        help="policy parameter the header lacks or to change, e.g. tau_s=1.0 (repeatable)",
    )
    p.add_argument("--full", action="store_true", help="include the simulator config it ran")
    p.set_defaults(fn=cmd_predict)
    p = sub.add_parser(
        "workload",
        help="the workload's statistics beside the paper's targets (docs/design/reference-numbers.md); --fit refits the preset's parameters",
    )
    p.add_argument(
        "config", nargs="?", default="-", help="TOML or JSON config file ('-' or none: --preset/--set)"
    )
    p.add_argument("--preset", help="e.g. nl2repo, nl2repo-2.4t")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override, e.g. workload.exclusion=per_execution"
    )
    p.add_argument("--queries", type=int, default=100_000, help="queries sampled (default 100000)")
    p.add_argument("--seed", type=int, default=1, help="sampling seed (default 1; the fit used 0)")
    p.add_argument("--fit", action="store_true", help="refit the preset's free parameters first")
    p.set_defaults(fn=cmd_workload)
    p = sub.add_parser(
        "plan",
        help="sweep (phi, mu), spares, the adaptive planner, Async splits and Colocate at each target staleness; "
        "recommend the fastest within the target (plan.json, plan.png)",
    )
    p.add_argument(
        "config", nargs="?", default="-", help="TOML or JSON config file ('-' or none: --preset/--set)"
    )
    p.add_argument("--preset", help="e.g. nl2repo")
    p.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override, e.g. cluster.nodes_per_cell=8"
    )
    p.add_argument("--trace", help="replay a recorded trace.jsonl as the workload")
    p.add_argument(
        "--staleness", type=float, nargs="+", default=[1.0, 1.5], help="target E[d] (default 1.0 1.5)"
    )
    p.add_argument(
        "--tolerance", type=float, default=0.05, help="realized staleness may exceed the target by this"
    )
    p.add_argument("--steps", type=int, help="optimizer steps to simulate (default: the config's)")
    p.add_argument("--out", help="output directory (default sched-out/NAME-plan)")
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser(
        "calibrate",
        help="fit the cost model (per token, per micro-step, start-up, tail, switches, publication, warm-up) to "
        "real run directories and report the fit error",
    )
    p.add_argument(
        "runs", nargs="+", help="run directories of gyre run (trace.jsonl, metrics/steps.jsonl, model/)"
    )
    p.set_defaults(fn=cmd_calibrate)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValidationError as e:
        print(f"gyre-sched: invalid config: {e}", file=sys.stderr)
    except ValueError as e:
        print(f"gyre-sched: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
