"""`python -m evenflow.gateway`: the gateway process (config from EVENFLOW_*)."""

import uvicorn

from evenflow.gateway.app import create_app
from evenflow.services.config import load_config

if __name__ == "__main__":
    config = load_config()
    config.configure_logging()
    uvicorn.run(create_app(config), host=config.host, port=config.port, loop="uvloop",
                log_level="warning" if config.log_level == "info" else config.log_level,
                timeout_graceful_shutdown=5)
