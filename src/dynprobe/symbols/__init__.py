"""ELF symbols and sections, /proc/PID/maps, and probe location resolution."""
