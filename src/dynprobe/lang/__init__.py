"""bpftrace's language for user space (`dynprobe run`, issue 21): read, checked, compiled into the target."""
