"""The arch-independent engine: the public Session, the runtime under it, its services (the stop
loop, the process table, patching, module tracking, the data path, detach) and its mechanisms
(trap probes, the optimizer, return probes, the function tracer)."""
