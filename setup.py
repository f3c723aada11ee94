"""The one part pyproject.toml cannot declare without an experimental table: the C dynprobe
runs in its own process. report's and flame's per-event walk (output/callwalk.c, called through
ctypes; the module itself is empty) and the upcall server's wait and answer
(core/upcalls.c)."""

from setuptools import Extension, setup

FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra"]

setup(
    ext_modules=[
        Extension("dynprobe.output._callwalk", sources=["src/dynprobe/output/callwalk.c"], extra_compile_args=FLAGS),
        Extension("dynprobe.core._upcalls", sources=["src/dynprobe/core/upcalls.c"], extra_compile_args=FLAGS),
    ]
)
