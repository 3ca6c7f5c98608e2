"""The uplink room: how response bytes leave the server (Crovella et al.,
"Connection scheduling in web servers"; Harchol-Balter et al., "Size-based scheduling to improve
web performance"; Al Sa'deh and Yahya, "A new scheduling policy in web servers"; Schroeder and
Harchol-Balter, "Web servers under overload").

The gateway writes every response through :mod:`.flow` (one
:class:`UplinkFlow` per response); the scheduler behind it is chosen by
:func:`make_uplink` (``--uplink fair|srpt|srrt|app``):

``fair``  nothing set: every socket drains into one FIFO (what Apache alone does); :mod:`.fair`.
``srpt``  Harchol-Balter et al. §2.2.4: the client socket's ``SO_PRIORITY`` = the kernel band of its
          remaining bytes, read from ``TCP_INFO`` and updated while the response drains;
          :mod:`.kernel`.
``srrt``  Al Sa'deh and Yahya §3: the band of the remaining *time* ``RTT · (1 + remaining/(cwnd·MSS))``;
          :mod:`.kernel`.
``app``   Crovella et al. §3.3: no kernel bands; the server orders its own writes, least remaining
          first, ``concurrency`` writers at a time; :mod:`.app`.

The rest of the room, imported by module name:

* :mod:`.bands`: cutoffs on remaining size or time (Harchol-Balter et al. §2.2.2's rule, adaptive);
* :mod:`.qdisc`: install, show and remove the priority qdisc (``overtake uplink``);
* :mod:`.tcpinfo`: ``TCP_INFO`` / ``SO_PRIORITY`` on a socket, Al Sa'deh and Yahya's remaining time;
* :mod:`.permits`: the least-remaining-first write turns of ``app`` and the ordered bands;
* :mod:`.metrics`: the per-band Prometheus collector;
* :mod:`.errors`: the error tree.
"""

from __future__ import annotations

from overtake.controller.uplink.app import AppUplink
from overtake.controller.uplink.bands import TOP_FRACTION, Cutoffs
from overtake.controller.uplink.errors import QdiscError, QdiscPermissionError, UplinkError, UplinkInputError
from overtake.controller.uplink.factory import NAMES, default_cutoffs, detect_bands, make_uplink
from overtake.controller.uplink.fair import FairUplink
from overtake.controller.uplink.flow import Uplink, UplinkFlow
from overtake.controller.uplink.kernel import BandStats, KernelUplink
from overtake.controller.uplink.metrics import UplinkCollector
from overtake.controller.uplink.qdisc import BandMap

__all__ = [
    "AppUplink",
    "BandMap",
    "BandStats",
    "Cutoffs",
    "FairUplink",
    "KernelUplink",
    "NAMES",
    "QdiscError",
    "QdiscPermissionError",
    "TOP_FRACTION",
    "Uplink",
    "UplinkCollector",
    "UplinkError",
    "UplinkFlow",
    "UplinkInputError",
    "default_cutoffs",
    "detect_bands",
    "make_uplink",
]
