"""`evenflow planner` / `python -m evenflow.planner [ID] [options]`: the planner process, against a
running mesh (config from EVENFLOW_*, the options over it). `evenflow up --planner` starts one;
started by hand it can join, replace or leave a mesh at any time."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from evenflow.planner.service import PlannerService
from evenflow.services.config import load_mesh_config
from evenflow.services.worker import run_worker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow planner", description=__doc__)
    ap.add_argument("id", nargs="?", default="plan0")
    ap.add_argument("--nats", help="the mesh's NATS (default: EVENFLOW_NATS_URL)")
    ap.add_argument("--ttft-ms", type=float)
    ap.add_argument("--itl-ms", type=float)
    ap.add_argument("--interval-s", type=float)
    ap.add_argument("--mode", choices=("switch", "restart", "scale", "advisory"))
    ap.add_argument("--max-workers", type=int, help="mode scale: at most this many workers")
    ap.add_argument("--profile", help="a roles profile (`evenflow profile-roles`)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    config = load_mesh_config()
    overrides = {name: value for name, value in (
        ("nats_url", args.nats), ("ttft_ms", args.ttft_ms), ("itl_ms", args.itl_ms),
        ("planner_interval_s", args.interval_s), ("planner_mode", args.mode),
        ("planner_profile", args.profile), ("max_workers", args.max_workers)) if value is not None}
    config = dataclasses.replace(config, **overrides)
    if not config.nats_url:
        ap.error("the mesh's NATS: --nats URL or EVENFLOW_NATS_URL")
    run_worker(PlannerService(config, args.id))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
