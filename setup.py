"""Build configuration beyond pyproject.toml: the optional C kernels of `p2p_diloco.protocol.fused`.

`_fused.c` is plain C (no Python API), loaded with ctypes. It is built with -O3 and -ffp-contract=off
and never -ffast-math: replicas must round every float32 operation exactly as the torch fallback does
(no FMA contraction, no reassociation); no -march, so the library runs on any x86-64 (SSE2) or other
CPU the wheel was built for. `optional=True`: without a C compiler the install still succeeds and the
package falls back to its torch kernels (same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "p2p_diloco.protocol._fused",
            sources=["p2p_diloco/protocol/_fused.c"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c99"],
            optional=True,
        )
    ]
)
