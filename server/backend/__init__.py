"""A session's own connection to the backend Postgres, as the restricted role: login, then relay.

`pending`: what the proxy expects back; `link`: the link, relaying and tracking;
`own_statements`: the proxy's own statements on it; `login`: connecting, logging in, cancelling.
"""

from server.backend.link import BackendError as BackendError
from server.backend.link import BackendLink as BackendLink
from server.backend.link import CycleCounter as CycleCounter
from server.backend.link import NonStandardStrings as NonStandardStrings
from server.backend.link import RelayTarget as RelayTarget
from server.backend.login import connect as connect
from server.backend.login import open_transport as open_transport
from server.backend.login import send_cancel as send_cancel
from server.backend.own_statements import INTERNAL_NAME as INTERNAL_NAME
from server.backend.own_statements import SHADOW_NAME as SHADOW_NAME
from server.backend.pending import Pending as Pending
