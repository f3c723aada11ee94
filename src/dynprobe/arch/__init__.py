"""Architecture layers. Only x86-64 exists; generic code imports `dynprobe.arch.x86_64` by name."""
