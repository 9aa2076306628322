"""The wheel's build step: compile the smartredis_io Redis module into the package.

Everything else about the distribution is in setup.cfg. ``pip wheel .`` carries the module
(``smartredis_io/redisai/srio_redisai.so``), so users need no compiler; an editable install finds
the one ``make setup`` built in place.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent


def _module_builder():
    spec = importlib.util.spec_from_file_location("_srio_module_build", ROOT / "smartredis_io" / "redisai" / "build.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    return builder


class BuildPyWithModule(build_py):
    """build_py, then the Redis module compiled into the built package (in place for an editable install)."""

    def run(self):
        super().run()
        builder = _module_builder()
        if self.editable_mode:
            builder.build()
        else:
            builder.build(Path(self.build_lib) / "smartredis_io" / "redisai" / builder.MODULE_NAME, force=True,
                          stamp=False)


class PlatformWheel(bdist_wheel):
    """A wheel for this platform (it holds a shared object) that any Python 3 takes (no CPython ABI is used)."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithModule, "bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)
