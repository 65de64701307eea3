"""`python -m evenflow.gateway`: the gateway process (config from EVENFLOW_*)."""

import logging

import uvicorn

from evenflow.gateway.app import create_app
from evenflow.services.config import load_config

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = load_config()
    uvicorn.run(create_app(config), host=config.host, port=config.port, loop="uvloop",
                log_level="warning", timeout_graceful_shutdown=5)
