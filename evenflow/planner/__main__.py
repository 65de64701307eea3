"""`python -m evenflow.planner [ID]`: the planner process (config from EVENFLOW_*)."""

import sys

from evenflow.planner.service import PlannerService
from evenflow.services.config import load_mesh_config
from evenflow.services.worker import run_worker

if __name__ == "__main__":
    run_worker(PlannerService(load_mesh_config(), sys.argv[1] if len(sys.argv) > 1 else "plan0"))
