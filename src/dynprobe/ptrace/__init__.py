"""Process control through ptrace: raw calls (syscalls), typed wait events, one traced process."""
