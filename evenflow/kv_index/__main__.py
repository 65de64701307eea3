"""`python -m evenflow.kv_index [ID]`: the KV index process (config from EVENFLOW_*)."""

import sys

from evenflow.kv_index.service import KVIndexService
from evenflow.services.config import load_mesh_config
from evenflow.services.worker import run_worker

if __name__ == "__main__":
    run_worker(KVIndexService(load_mesh_config(), sys.argv[1] if len(sys.argv) > 1 else "kv0"))
