"""Builds nodekv._C, the C++ host-side pieces (csrc/), with pybind11; everything else is in pyproject.toml.

Every csrc/*.cpp present is compiled. No -mavx2 & co. globally: the SIMD kernels carry
`__attribute__((target(...)))` and are picked at run time, so the build runs on any x86-64.
"""
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).resolve().parent
SOURCES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").glob("*.cpp"))
HEADERS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").glob("*.h"))  # a header edit rebuilds

ext = Pybind11Extension(
    "nodekv._C",
    SOURCES,
    include_dirs=["csrc"],
    depends=HEADERS,
    cxx_std=17,
    extra_compile_args=["-O3", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
