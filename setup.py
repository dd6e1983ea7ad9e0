"""Build configuration beyond pyproject.toml: the optional C kernels of `p2p_diloco.protocol.fused`.

`_fused.c` is plain C (no Python API), loaded with ctypes. It is built with -O3 and -ffp-contract=off
and never -ffast-math: replicas must round every float32 operation exactly as the torch fallback does
(no FMA contraction, no reassociation); no -march, so the library runs on any x86-64 (SSE2) or other
CPU the wheel was built for. `optional=True`: without a C compiler the install still succeeds and the
package falls back to its torch kernels (same results, slower).

Nothing in the library depends on the Python that built it, so the wheel is tagged `py3-none-<platform>`
(installs on any CPython >= 3.11 of that platform) and the library is named `_fused.abi3.so`, a suffix
every CPython 3 imports (and so `importlib.util.find_spec` finds), not `_fused.cpython-311-...so`.
"""

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

LIBRARY_SUFFIX = ".abi3.so"  # in importlib.machinery.EXTENSION_SUFFIXES of every CPython 3 on Linux


class PlainLibraryBuild(build_ext):
    """Names the ctypes library `<name>.abi3.so` whatever the Python that builds it."""

    def get_ext_filename(self, fullname: str) -> str:
        return fullname.replace(".", "/") + LIBRARY_SUFFIX


class AnyPythonWheel(bdist_wheel):
    """A platform wheel (it carries a compiled library) for every Python 3: `py3-none-<platform>`."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        _python, _abi, platform = super().get_tag()
        return "py3", "none", platform


EXT_MODULES = [
    Extension(
        "p2p_diloco.protocol._fused",
        sources=["p2p_diloco/protocol/_fused.c"],
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-std=c99"],
        optional=True,
    )
]

if __name__ == "__main__":
    setup(ext_modules=EXT_MODULES, cmdclass={"build_ext": PlainLibraryBuild, "bdist_wheel": AnyPythonWheel})
