"""The mesh on Ray Serve: one deployment per service, each scaling on its own signal, with NATS
and Redis still the data plane. Deploy code: it imports the services' entry points; nothing in
the mesh imports it."""
