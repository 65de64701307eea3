"""`python -m evenflow.balancer [ID]`: the balancer process (config from EVENFLOW_*)."""

import sys

from evenflow.balancer.service import BalancerService
from evenflow.services.config import load_mesh_config
from evenflow.services.worker import run_worker

if __name__ == "__main__":
    run_worker(BalancerService(load_mesh_config(), sys.argv[1] if len(sys.argv) > 1 else "eplb0"))
