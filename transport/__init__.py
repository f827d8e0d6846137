"""aggnet transports: one interface (:mod:`.base`), one module per transport,
chosen by address scheme."""

from aggnet.transport.base import Connection, Incoming, Listener, TransportError, connect, listen

__all__ = ["Connection", "Incoming", "Listener", "TransportError", "connect", "listen"]
