"""Benchmarks of the mesh: requests through gateways and workers (serve, routing, frontend,
hand-off, pulls, soak, hosts) and the wire codec, with the peers they compare against."""
