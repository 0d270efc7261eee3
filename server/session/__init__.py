"""A client session: start-up, then every message routed in order (the layers in `base`)."""

from server.session.base import SessionCore, SessionHost, State
from server.session.client import ClientProtocol, Session

__all__ = ["ClientProtocol", "Session", "SessionCore", "SessionHost", "State"]
