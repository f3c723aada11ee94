"""The one part pyproject.toml cannot declare without an experimental table: report's and
flame's per-event walk, C whose functions ctypes calls (output/callwalk.py; the module itself is
empty)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dynprobe.output._callwalk",
            sources=["src/dynprobe/output/callwalk.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
        )
    ]
)
