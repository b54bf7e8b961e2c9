"""`edge-agent cgroup show|apply --dry-run`: our cgroup v2 subtree, read-only.

    edge-agent cgroup show [--json]
    edge-agent cgroup apply --dry-run [--policy NAME] [--model NAME --budget BYTES]

`show` prints detection (mount, our cgroup, delegation, PSI) and the current values of our
subtree; it exits 0 whatever it finds (`edge-agent doctor` is the pass/fail check). `apply`
prints the writes the daemon would do at start (and for one model's runner) without touching
anything; the daemon applies them itself, since moving this CLI process would be wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from edge_agent.cgroup import CgroupManager, CgroupRoot, load_policy
from edge_agent.cgroup.psi import PressureError, read_pressure
from edge_agent.errors import UsageError
from edge_agent.sizes import parse_size

__all__ = ["register", "run_show", "run_apply", "manager_for"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("cgroup", help="show our cgroup v2 subtree; dry-run the policy",
                            description="cgroup v2 memory layout of the daemon: detection, "
                            "current values, and the writes a policy implies.")
    csub = parser.add_subparsers(dest="cgroup_command", metavar="ACTION", required=True)
    show = csub.add_parser("show", help="detection and current values of our subtree",
                           description="Print the cgroup2 mount, our cgroup, delegation, PSI "
                           "and the memory values of supervisor/ and models/*.")
    show.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    show.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    show.set_defaults(func=run_show)
    apply = csub.add_parser("apply", help="print the writes a policy implies (--dry-run)",
                            description="Print, without writing anything, the cgroup writes "
                            "the daemon does at start and for a model's runner.")
    apply.add_argument("--dry-run", action="store_true", required=True,
                       help="print the writes instead of doing them (required)")
    apply.add_argument("--policy", default="default", metavar="NAME",
                       help="policy from cgroups/ or a .toml path (default: %(default)s)")
    apply.add_argument("--model", metavar="NAME", help="also plan this model's runner group")
    apply.add_argument("--budget", metavar="BYTES",
                       help="the model's computed budget (e.g. 700M) for relative limits")
    apply.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    apply.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    apply.set_defaults(func=run_apply)


def manager_for(args: argparse.Namespace) -> CgroupManager:
    return CgroupManager.detect(CgroupRoot(proc=Path(args.proc_root)))


def _pressure(mgr: CgroupManager) -> dict[str, Any] | None:
    pfile = mgr.detection.pressure_file
    if pfile is None or mgr.detection.psi != "enabled":
        return None
    try:
        return {"file": str(pfile), **read_pressure(pfile).to_dict()}
    except PressureError:
        return None


def run_show(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    mgr = manager_for(args)
    snap = mgr.snapshot()
    snap["pressure"] = _pressure(mgr)
    if args.json:
        print(json.dumps(snap, indent=2), file=out)
        return 0
    d = mgr.detection
    lines = [f"cgroup v2:   {'available' if d.available else 'NOT available'}"]
    if not d.available:
        lines += [f"  missing:   {d.reason}", f"  fix:       {d.fix}"]
    lines += [
        f"mount:       {d.mount or '-'}",
        f"our cgroup:  {d.cgroup or '-'}" + (" (already set up)" if d.already_set_up else ""),
        f"controllers: {' '.join(d.controllers) or '-'}",
        f"subtree:     {' '.join(d.subtree_control) or '-'}",
        f"writable:    {'-' if d.writable is None else ('yes' if d.writable else 'no')}",
        f"PSI:         {d.psi} ({d.psi_detail})",
    ]
    p = snap["pressure"]
    if p:
        lines.append(f"pressure:    some avg10={p['some_avg10']:.2f} avg60={p['some_avg60']:.2f} "
                     f"avg300={p['some_avg300']:.2f}")
    for rel, vals in snap["groups"].items():
        lines.append(f"{rel}/")
        for k, v in vals.items():
            if isinstance(v, dict):
                v = " ".join(f"{a}={b}" for a, b in v.items())
            lines.append(f"  {k:<18} {v}")
    print("\n".join(lines), file=out)
    return 0


def run_apply(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if args.budget is not None and not args.model:
        raise UsageError("cgroup apply: --budget given without --model. Hint: add "
                         "--model NAME to plan that model's runner group.")
    budget = None
    if args.budget is not None:
        try:
            budget = parse_size(args.budget, allow_max=False)
        except ValueError as exc:  # a flag, not the configuration: usage (exit 2)
            raise UsageError(f"cgroup apply --budget {args.budget!r}: {exc}. Hint: e.g. "
                             "--budget 700M.") from None
        if budget is None or budget <= 0:
            raise UsageError(f"cgroup apply --budget {args.budget!r}: a budget of 0 bytes would "
                             "plan memory.max 0 for the runner. Hint: e.g. --budget 700M.")
    policy = load_policy(args.policy)
    mgr = manager_for(args)
    ops = mgr.plan_setup(policy)
    if args.model:
        ops += mgr.plan_model(args.model, budget, policy)
    mount = mgr.detection.mount or Path("/sys/fs/cgroup")
    if args.json:
        print(json.dumps({"policy": policy.to_dict(), "available": mgr.detection.available,
                          "reason": mgr.detection.reason or None, "mount": str(mount),
                          "writes": [op.to_dict() for op in ops]}, indent=2), file=out)
        return 0
    if not mgr.detection.available:
        print(f"edge-agent: note: cgroup v2 is not usable here ({mgr.detection.reason}); "
              "these writes would not be attempted. Fix: " + mgr.detection.fix, file=sys.stderr)
    print(f"# policy {policy.name} ({policy.path}): dry run, nothing written", file=out)
    for op in ops:
        print(op.describe(mount), file=out)
    return 0
