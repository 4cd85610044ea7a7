"""The registry served over ZeroMQ: `wire` (the protocol, sans-IO), `server`, `client`.

Needs pyzmq (the `service` extra); the core reaches it only through
`weightpull.registry.connect_registry`, lazily.
"""
