"""Links of a cache hierarchy: each transfer route by bandwidth and base latency, shared
links included, from a named profile of datasheet figures.

A *route* is one hop a chunk's bytes take (:data:`ROUTES`): ``l1_device`` (the server's
shared-memory pool into the accelerator, the hop every load ends with), ``l2_l1`` (a disk
tier's prefetch into L1), ``l1_l2`` (a write-through or write-back into the disk tier), and
``remote_l1`` / ``l1_remote`` / ``p2p_l1`` for a remote store and the fleet's peers. A
:class:`TierProfile` maps each route to a :class:`Link` and a direction. Routes on one link
share it: a *duplex* link (PCIe, Ethernet, RDMA) carries each direction at its full rate at
once, a half-duplex one (a disk) time-shares reads and writes, so a prefetch and a write-back
on one disk take the sum of their times.

Time of one request's load of ``h`` host, ``d`` disk, ``r`` remote and ``p`` peer tokens
(``b`` bytes per token; ``w`` tokens written to the disk meanwhile)::

    prefetch = max over the lower routes used (l2_l1 with l1_l2's w sharing the disk,
               remote_l1, p2p_l1) of  latency + bytes / (rate x efficiency)
    load     = prefetch + latency(l1_device) + (h + d + r + p) b / rate(l1_device)

(the server brings every lower-tier hit into L1 before the worker copies it to the device).
METRICS.md ("Time per link") states this once. Figures are datasheet peaks with their source;
the base latencies and the 0.8 efficiency are assumptions until ``kvtb bench`` measures them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

ROUTES = ("l1_device", "l2_l1", "l1_l2", "remote_l1", "l1_remote", "p2p_l1")
READ, WRITE = "read", "write"
LOWER_ROUTES = {"disk": "l2_l1", "remote": "remote_l1", "p2p": "p2p_l1"}
"""Per hit source below L1, the route its prefetch into L1 takes."""


@dataclass(frozen=True)
class Link:
    """One physical link or device, its rates per direction and fixed cost per transfer."""

    name: str
    read_bytes_per_s: float
    """Rate of ``read`` transfers (out of a disk; one direction of a duplex link)."""
    write_bytes_per_s: float
    latency_s: float
    """Fixed cost of one transfer (one request's prefetch or load on this link)."""
    duplex: bool
    """Both directions at full rate at once (a bus or network); ``False``: they time-share."""
    source: str
    efficiency: float = 0.8
    """Share of the datasheet rate reached (an assumption until measured)."""

    def __post_init__(self) -> None:
        if not (self.read_bytes_per_s > 0 and self.write_bytes_per_s > 0):
            raise ValueError(f"link {self.name!r}: rates must be positive")
        if self.latency_s < 0 or not 0 < self.efficiency <= 1:
            raise ValueError(f"link {self.name!r}: latency_s >= 0 and efficiency in (0, 1]")

    def rate(self, direction: str) -> float:
        nominal = self.read_bytes_per_s if direction == READ else self.write_bytes_per_s
        return nominal * self.efficiency


_GB = 1e9
_PCIE = "PCI-SIG PCI Express Base Specification"
LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("pcie4x16", 31.5 * _GB, 31.5 * _GB, 2e-6, True,
             f"{_PCIE} 4.0: 16 GT/s x16, 128b/130b, about 31.5 GB/s per direction"),
        Link("pcie5x16", 63 * _GB, 63 * _GB, 2e-6, True,
             f"{_PCIE} 5.0: 32 GT/s x16, 128b/130b, about 63 GB/s per direction"),
        Link("ddr5-4800x8", 307.2 * _GB, 307.2 * _GB, 1e-7, False,
             "JEDEC JESD79-5 DDR5-4800: 38.4 GB/s per 64-bit channel, 8 channels per socket"),
        Link("nvme-gen4", 7.45 * _GB, 6.9 * _GB, 7e-5, False,
             "Samsung 990 PRO datasheet (PCIe 4.0 x4 NVMe): sequential read 7,450 MB/s, "
             "write 6,900 MB/s; 70 us per transfer assumed"),
        Link("nvme-gen5", 14.8 * _GB, 13.4 * _GB, 5e-5, False,
             "Samsung 9100 PRO datasheet (PCIe 5.0 x4 NVMe): sequential read 14,800 MB/s, "
             "write 13,400 MB/s; 50 us per transfer assumed"),
        Link("eth25", 3.125 * _GB, 3.125 * _GB, 2.5e-5, True,
             "IEEE 802.3by 25GBASE: 25 Gb/s per direction; 25 us TCP round trip assumed"),
        Link("eth100", 12.5 * _GB, 12.5 * _GB, 2e-5, True,
             "IEEE 802.3ba 100GBASE: 100 Gb/s per direction; 20 us TCP round trip assumed"),
        Link("eth400", 50 * _GB, 50 * _GB, 1.5e-5, True,
             "IEEE 802.3bs 400GBASE: 400 Gb/s per direction; 15 us TCP round trip assumed"),
        Link("rdma400", 50 * _GB, 50 * _GB, 5e-6, True,
             "NVIDIA ConnectX-7 datasheet: 400 Gb/s InfiniBand NDR / RoCE per port; 5 us "
             "per RDMA read assumed"),
    )
}  # fmt: skip
"""Named links with their datasheet figures (``source`` says which)."""


@dataclass(frozen=True)
class TierProfile:
    """A hierarchy's hardware: per route, the link it takes and in which direction."""

    name: str
    routes: Mapping[str, tuple[str, str]]
    """route -> (link name, ``read`` | ``write``); every route of :data:`ROUTES`."""
    links: Mapping[str, Link] = field(default_factory=lambda: LINKS)

    def __post_init__(self) -> None:
        missing = sorted(set(ROUTES) - set(self.routes))
        unknown = sorted({link for link, _ in self.routes.values()} - set(self.links))
        if missing or unknown:
            raise ValueError(
                f"tier profile {self.name!r}: routes missing {missing}, unknown links {unknown}"
            )

    def link(self, route: str) -> tuple[Link, str]:
        name, direction = self.routes[route]
        return self.links[name], direction

    def transfer_s(self, route: str, num_bytes: np.ndarray) -> np.ndarray:
        """Per request: ``num_bytes`` over ``route`` alone (0 where nothing moves)."""
        link, direction = self.link(route)
        moved = np.asarray(num_bytes, dtype=np.float64)
        return np.where(moved > 0, link.latency_s + moved / link.rate(direction), 0.0)

    def prefetch_s(
        self, bytes_by_source: Mapping[str, np.ndarray], written_bytes: np.ndarray | float = 0.0
    ) -> np.ndarray:
        """Per request: bringing its lower-tier hits into L1 (``bytes_by_source``: ``disk``,
        ``remote``, ``p2p``), the routes in parallel, ``written_bytes`` going L1 -> L2 at the
        same time (sharing the disk when it is half-duplex)."""
        times = [np.zeros(1)]
        for source, moved in bytes_by_source.items():
            route = LOWER_ROUTES[source]
            time_s = self.transfer_s(route, moved)
            if route == "l2_l1":
                time_s = time_s + self._shared_write_s(moved, written_bytes)
            times.append(time_s)
        return np.maximum.reduce(np.broadcast_arrays(*times))

    def load_s(
        self,
        bytes_by_source: Mapping[str, np.ndarray],
        written_bytes: np.ndarray | float = 0.0,
    ) -> np.ndarray:
        """Per request: the prefetch, then every hit byte over ``l1_device``
        (``bytes_by_source`` includes ``host``)."""
        lower = {s: b for s, b in bytes_by_source.items() if s != "host"}
        total = sum((np.asarray(b, dtype=np.float64) for b in bytes_by_source.values()), 0.0)
        return self.prefetch_s(lower, written_bytes) + self.transfer_s(
            "l1_device", np.asarray(total, dtype=np.float64)
        )

    def _shared_write_s(self, moved: np.ndarray, written: np.ndarray | float) -> np.ndarray:
        read_link, _ = self.link("l2_l1")
        write_link, direction = self.link("l1_l2")
        if write_link.name != read_link.name or read_link.duplex:
            return np.zeros_like(np.asarray(moved, dtype=np.float64))
        busy = np.asarray(written, dtype=np.float64) / write_link.rate(direction)
        return np.where(np.asarray(moved) > 0, busy, 0.0)


def _profile(name: str, bus: str, disk: str, network: str, peer: str) -> TierProfile:
    return TierProfile(
        name,
        {
            "l1_device": (bus, READ),
            "l2_l1": (disk, READ),
            "l1_l2": (disk, WRITE),
            "remote_l1": (network, READ),
            "l1_remote": (network, WRITE),
            "p2p_l1": (peer, READ),
        },
    )


TIER_PROFILES: dict[str, TierProfile] = {
    p.name: p
    for p in (
        _profile("gen4", "pcie4x16", "nvme-gen4", "eth25", "eth100"),
        _profile("gen5", "pcie5x16", "nvme-gen5", "eth100", "rdma400"),
        _profile("gen5-400g", "pcie5x16", "nvme-gen5", "eth400", "rdma400"),
    )
}
"""Named hierarchies: ``gen4`` (PCIe 4.0 host link, a PCIe 4.0 NVMe disk, 25 GbE to the
remote store, 100 GbE to peers), ``gen5`` (PCIe 5.0, a PCIe 5.0 NVMe disk, 100 GbE, RDMA
400 Gb/s to peers), ``gen5-400g`` (as gen5 with 400 GbE to the remote store)."""


def tier_profile(name: str) -> TierProfile:
    if name not in TIER_PROFILES:
        raise ValueError(f"unknown tier profile {name!r}; choose one of {', '.join(TIER_PROFILES)}")
    return TIER_PROFILES[name]
