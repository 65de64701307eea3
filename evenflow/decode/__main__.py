"""`python -m evenflow.decode WORKER_ID`: one decode worker process (config from EVENFLOW_*)."""

import sys

from evenflow.decode.service import DecodeWorker
from evenflow.services.config import load_mesh_config
from evenflow.services.worker import run_worker

if __name__ == "__main__":
    run_worker(DecodeWorker(load_mesh_config(), sys.argv[1] if len(sys.argv) > 1 else "d0"))
