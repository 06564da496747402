"""Build step of Edge0's optional CPU kernels (csrc/, an MLX extension built with CMake + nanobind).

`pip install -e .` runs it; the project metadata is in pyproject.toml. The extension is built against
the MLX of the environment being installed into when it has one (else the build environment's, which
pip resolves like the runtime's), and pinned to that MLX version. It is optional: no compiler, no
CMake, or a failed build leave a pure-Python install that uses MLX's kernels (setuptools warns).
EDGE0_NO_KERNELS=1 skips it.
"""

import glob
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

PROBE = ("import os, mlx.core as mx; d = os.path.dirname(mx.__file__); "
         "print(os.path.join(d, 'share', 'cmake', 'MLX')); print(mx.__version__)")


def find_mlx():
    """(cmake dir, version) of the MLX to build against: the target environment's first."""
    isolated = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    for env in (isolated, os.environ):  # pip's build isolation works through PYTHONPATH
        r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
        if r.returncode == 0:
            cmake_dir, version = r.stdout.split()
            if os.path.isdir(cmake_dir):
                return cmake_dir, version
    raise CompileError("no MLX with its CMake config found (Linux needs mlx[cpu])")


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        try:
            self._cmake(ext)
        except (OSError, subprocess.CalledProcessError, ImportError) as e:
            raise CompileError(f"edge0 CPU kernels not built ({e}); MLX's kernels will be used") from e

    def _cmake(self, ext):
        import nanobind

        if not shutil.which("cmake"):
            raise CompileError("cmake not found")
        mlx_dir, mlx_version = find_mlx()
        target = self.get_ext_fullpath(ext.name)
        build = os.path.join(self.build_temp, "csrc")
        out = tempfile.mkdtemp(prefix="edge0-kernels-")
        args = ["cmake", "-S", ext.sources[0], "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                f"-DPython_EXECUTABLE={sys.executable}", f"-DMLX_DIR={mlx_dir}",
                f"-Dnanobind_DIR={nanobind.cmake_dir()}", f"-DEDGE0_OUTPUT_DIR={out}",
                f"-DEDGE0_MLX_VERSION={mlx_version}"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        subprocess.run(args, check=True)
        subprocess.run(["cmake", "--build", build, "--parallel"], check=True)
        built = glob.glob(os.path.join(out, "_kernels*"))
        if not built:
            raise CompileError("cmake produced no _kernels module")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)  # the name setuptools expects (abi3 builds are named otherwise)
        shutil.rmtree(out, ignore_errors=True)


kernels = [] if os.environ.get("EDGE0_NO_KERNELS") else [Extension("edge0.compute._kernels", ["csrc"], optional=True)]
setup(ext_modules=kernels, cmdclass={"build_ext": CMakeBuild})
