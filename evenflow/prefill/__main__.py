"""`python -m evenflow.prefill WORKER_ID`: one prefill worker process (config from EVENFLOW_*)."""

import sys

from evenflow.prefill.service import PrefillWorker
from evenflow.services.config import load_mesh_config
from evenflow.services.worker import run_worker

if __name__ == "__main__":
    run_worker(PrefillWorker(load_mesh_config(), sys.argv[1] if len(sys.argv) > 1 else "p0"))
