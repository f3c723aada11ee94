"""Output formats: ftrace-style text lines and JSON lines."""
