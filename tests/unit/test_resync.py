"""Which sites a library load looks at again (Modules._sync_sites): all of them, but those inside
an executable mapping that is the same as at the last sync."""

from __future__ import annotations

from typing import Any

from dynprobe.core.modules import sites_to_recheck
from dynprobe.symbols.maps import Mapping


def text(start: int, end: int, inode: int, perms: str = "r-xp") -> Mapping:
    return Mapping(start, end, perms, 0x1000, 0x801, inode, f"/lib/{inode}.so")


def test_only_sites_outside_unchanged_mappings_are_looked_at_again() -> None:
    main, lib, other = text(0x1000, 0x5000, 1), text(0x10000, 0x20000, 2), text(0x10000, 0x20000, 3)
    data = text(0x5000, 0x6000, 1, "rw-p")
    sites: dict[int, Any] = dict.fromkeys([0x1000, 0x4FFF, 0x5800, 0x10000, 0x1FFFF, 0x30000])
    assert sites_to_recheck(sites, None, [main]) == sorted(sites)  # no earlier map: every site
    # Nothing changed: the sites of both modules are skipped; the others are looked at (one in
    # a data mapping, one outside every mapping).
    assert sites_to_recheck(sites, [main, data, lib], [main, data, lib]) == [0x5800, 0x30000]
    # Another library at the same address: its sites are looked at again, the program's are not.
    assert sites_to_recheck(sites, [main, data, lib], [main, data, other]) == [0x5800, 0x10000, 0x1FFFF, 0x30000]
    # The library is gone, and the map of the last sync was read after it went (a probe placed
    # in between): its sites are outside every earlier mapping, so they are looked at.
    assert sites_to_recheck(sites, [main, data], [main, data]) == [0x5800, 0x10000, 0x1FFFF, 0x30000]
