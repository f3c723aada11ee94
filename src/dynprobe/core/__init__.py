"""The arch-independent engine: probes, sites, slots, the session and its event loop."""
