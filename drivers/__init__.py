"""Transport drivers. Each module implements `weightpull.transport.Transport` and is
loaded by name through `weightpull.transports`, never imported by the core."""
