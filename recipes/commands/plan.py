"""`mpmd plan goodput CONFIG [key=value ...]`: the goodput a run of the config would have under
failures, and the checkpoint intervals that maximise it, from measured costs (the simulator:
mpmd/tuner/goodput.py, the search mpmd/tuner/intervals.py; the costs a run directory measured: mpmd/report/costs.py).

What is simulated comes from the config: checkpoint.every and memory_every (the configured
policy, compared with the best), cluster.on_loss and replace_timeout_s, cluster.hot_spares
where the config has it, cluster.processes_per_slice (a gang's hosts); and from its plan.*
keys: the slices, hosts and their MTBF, the wall time, the costs. Nothing starts: no worker,
no JAX. Exit status: 0 done, 2 a bad config or plan.from_run (one line).
"""

from __future__ import annotations

import argparse
import sys
import time

from mpmd.recipes import config
from mpmd.recipes.commands.arguments import config_arguments, section_keys
from mpmd.recipes.run import console
from mpmd.tuner import goodput, intervals

# The causes a page prints, shortened to fit a column.
SHORT = {"capacity": "capac", "promote": "prom", "relayout": "relay", "restore": "rest", "compile": "comp"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpmd plan",
        description="Plan a long run before starting it (mpmd plan MODE --help: its arguments).",
        epilog="example:\n  mpmd plan goodput configs/gpt_tiny.yaml plan.num_slices=1024 plan.mtbf_h=1000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="mode", required=True)
    g = sub.add_parser(
        "goodput",
        help="goodput under failures, and the checkpoint intervals that maximise it",
        description="Simulate the config's run on plan.num_slices slices for plan.wall_h hours, hosts "
        "failing every plan.mtbf_h hours, with measured costs (plan.from_run=RUN_DIR reads them from "
        "a run's records); print its goodput and lost time by cause, the checkpoint.every and "
        "memory_every that maximise goodput, and Young/Daly's intervals beside.",
        epilog=f"{section_keys('plan', config.PlanConfig)}\n\nexamples:\n"
        "  mpmd plan goodput configs/gpt_tiny.yaml plan.num_slices=1024 plan.mtbf_h=1000\n"
        "  mpmd plan goodput configs/gpt_tiny.yaml plan.from_run=runs/gpt_tiny plan.slices_per_host=8 "
        "cluster.on_loss=shrink",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config_arguments(g)
    return p


def inputs(cfg: config.Config) -> tuple[goodput.Costs, dict, goodput.Hosts, goodput.Policy]:
    """(costs, where each came from, hosts, the configured policy) of cfg's plan section: a
    cost given as a key, else measured by plan.from_run, else the default."""
    p = cfg.plan
    measured = {}
    if p.from_run is not None:
        from mpmd.report.costs import measured as measure

        try:
            measured = measure(p.from_run)
        except (OSError, ValueError) as e:
            raise config.ConfigError(f"plan.from_run={p.from_run!r}: {e}") from None
    values, sources = {}, {}
    for name in goodput.Costs._fields:
        given = getattr(p, name)
        if given is not None:
            values[name], sources[name] = given, "given"
        elif name in measured:
            values[name], sources[name] = measured[name], "measured"
        else:
            sources[name] = "default"
    pps = cfg.cluster.processes_per_slice
    if pps > 1 and p.slices_per_host > 1:
        raise config.ConfigError(
            f"plan.slices_per_host={p.slices_per_host} with cluster.processes_per_slice={pps}: a host holds "
            f"several slices or a slice spans several hosts, not both; set one of them to 1"
        )
    hosts = goodput.Hosts(p.num_slices or cfg.num_workers, p.mtbf_h * 3600.0, p.slices_per_host, pps)
    spares = p.hot_spares if p.hot_spares is not None else getattr(cfg.cluster, "hot_spares", None) or 0
    policy = goodput.Policy(
        cfg.checkpoint.every,
        cfg.checkpoint.memory_every,
        spares,
        cfg.cluster.on_loss,
        p.replace_wait_s,
        cfg.cluster.replace_timeout_s,
    )
    return goodput.Costs(**values), sources, hosts, policy


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def table(plan: intervals.Plan) -> str:
    """The configured, best and Young/Daly rows, then the next best candidates: goodput (the
    mean over trials, its standard error) and the time lost by cause, % of the wall."""
    head = f"{'':<11} {'every':>7} {'memory':>7} {'goodput':>7} {'±':>6} " + " ".join(
        f"{SHORT.get(c, c):>6}" for c in goodput.CAUSES
    )
    rows = [("configured", plan.configured), ("best", plan.best), ("Young/Daly", plan.young_daly)]
    rows += [("", c) for c in plan.ranked[1:5]]
    lines = [f"{'':<43}time lost by cause, % of the wall", head]
    for name, c in rows:
        lines.append(
            f"{name:<11} {c.policy.every:>7} {c.policy.memory_every:>7} {c.goodput:>7.4f} {c.goodput_error:>6.4f} "
            + " ".join(f"{100 * c.lost_share[cause]:>6.2f}" for cause in goodput.CAUSES)
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = config.load(args.config, args.overrides)
        console.to_console(console.level(cfg.log.level))
        costs, sources, hosts, policy = inputs(cfg)
        t0 = time.perf_counter()
        plan = intervals.plan(costs, hosts, policy, cfg.plan.wall_h * 3600.0, cfg.plan.seed)
    except (config.ConfigError, ValueError) as e:
        console.error(e)
        return 2
    seconds = time.perf_counter() - t0
    per_host = f"{hosts.slices_per_host} slice(s) each" if hosts.hosts_per_slice == 1 else "gangs"
    print(
        f"{hosts.num_slices} slices on {hosts.num_hosts} hosts ({per_host}) and the controller's, each failing every "
        f"{_duration(hosts.mtbf_s)}: the job every {_duration(hosts.failure_every_s)}; a {_duration(cfg.plan.wall_h * 3600)} "
        f"run ({_duration(plan.simulated_wall_s)} simulated, {plan.failures_per_run:.1f} failures, {plan.trials} trials, "
        f"{len(plan.ranked)} candidates, {seconds:.1f} s)"
    )
    print("costs (s): " + ", ".join(f"{k[:-2]} {v:.3g} ({sources[k]})" for k, v in costs._asdict().items()))
    print(
        f"policy: on_loss {policy.on_loss} (replace_timeout_s {policy.replace_timeout_s:g}), replace_wait_s "
        f"{policy.replace_wait_s:g}, hot spares {policy.hot_spares}; the in-memory tier can serve "
        f"{hosts.memory_share:.1%} of failures"
    )
    print(table(plan))
    print(
        "Young/Daly: every = sqrt(2 x MTBF x save_s) / step_s, memory_every the same with snapshot_s, "
        "MTBF that of the failures each tier serves"
    )
    best = plan.best.policy
    print(f"choose: checkpoint.every={best.every} checkpoint.memory_every={best.memory_every}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
