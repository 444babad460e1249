"""pip install --no-build-isolation .  builds the Python package blockswap against the torch
that is installed (torch 2.7 to 2.14), with the project's own CMake build: the same sources, the
same flags and the same checks as `cmake` and scripts/test, so that what ccache holds from one
is reused by the other (the build tree is build-pip-torch-VERSION, beside CMake's build/).

The built package requires exactly that torch and refuses another at import. Where that torch
has CUDA, the CUDA backend is built against the CUDA runtime torch itself loads (pip's nvidia
runtime package beside torch) or a toolkit of the same major version; with neither, the package
is built without it and the build says so, and how to point at one
(cmake/BlockswapTorch.cmake). It needs CMake 3.22 or newer (`pip install cmake ninja` where the
machine has none) and a C++20 compiler."""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

TORCH_MIN, TORCH_MAX = (2, 7), (2, 14)
CMAKE_MIN = (3, 22)

try:
    import torch
except ImportError:
    sys.exit("blockswap compiles against the torch it will run with, and this build cannot see "
             "one: either this environment has no torch (install torch 2.7-2.14 first), or pip "
             "built in an isolated environment, as it does unless told otherwise. Then: "
             "pip install --no-build-isolation .")

torch_version = torch.__version__.split("+")[0]
if tuple(int(x) for x in torch_version.split(".")[:2]) < TORCH_MIN:
    sys.exit(f"blockswap needs torch {TORCH_MIN[0]}.{TORCH_MIN[1]} to "
             f"{TORCH_MAX[0]}.{TORCH_MAX[1]}; this is torch {torch.__version__}")

root = os.path.dirname(os.path.abspath(__file__))


def tool(name):
    """The program `name` from PATH, else from its PyPI package in this environment."""
    found = shutil.which(name)
    if found:
        return found
    try:
        module = __import__(name)
    except ImportError:
        return None
    candidate = os.path.join(getattr(module, "BIN_DIR", getattr(module, "CMAKE_BIN_DIR", "")), name)
    return candidate if os.path.exists(candidate) else None


def cmake_program():
    cmake = tool("cmake")
    if cmake:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
        match = re.search(r"(\d+)\.(\d+)", out)
        if match and tuple(int(x) for x in match.groups()) >= CMAKE_MIN:
            return cmake
    sys.exit(f"blockswap builds with CMake {CMAKE_MIN[0]}.{CMAKE_MIN[1]} or newer, and "
             f"{'this one is older' if cmake else 'none was found'}: pip install cmake ninja "
             "(or your system's cmake), then run the same pip install again.")


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        cmake = cmake_program()
        build_dir = os.path.join(root, "build-pip-torch-" + torch.__version__)
        # One build tree per torch and Python: a tree configured for another Python starts over.
        stamp = os.path.join(build_dir, "blockswap-python.txt")
        if os.path.exists(stamp) and open(stamp).read() != sys.executable:
            shutil.rmtree(build_dir)
        os.makedirs(build_dir, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(sys.executable)

        env = dict(os.environ)
        args = [cmake, "-S", root, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
                f"-DBLOCKSWAP_TORCH_PYTHON={sys.executable}", "-DBLOCKSWAP_PYTHON=ON",
                "-DBLOCKSWAP_BUILD_TESTS=OFF", "-DBLOCKSWAP_BUILD_TOOLS=OFF",
                "-DBLOCKSWAP_BUILD_BENCH=OFF"]
        ninja = tool("ninja")
        if ninja:
            args += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
        if shutil.which("ccache"):
            # As scripts/test sets it: paths relative to the checkout, so that CMake's build and
            # this one share what ccache holds.
            args.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
            env.setdefault("CCACHE_BASEDIR", root)
            env.setdefault("CCACHE_NOHASHDIR", "true")
            env.setdefault("CCACHE_SLOPPINESS",
                           "pch_defines,time_macros,include_file_mtime,include_file_ctime")
        subprocess.check_call(args, env=env)
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.check_call([cmake, "--build", build_dir, "--target", "blockswap_python",
                               "-j", jobs], env=env)

        module_dir = os.path.join(build_dir, "python", "blockswap")
        built = [f for f in os.listdir(module_dir) if f.startswith("_C") and f.endswith(".so")]
        if len(built) != 1:
            sys.exit(f"blockswap: expected one extension module in {module_dir}, found {built}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(module_dir, built[0]), target)


setup(
    name="blockswap",
    version="0.1.0",
    description="Block swapping for models larger than device memory: a drop-in ModelOffloader",
    package_dir={"": "python"},
    packages=["blockswap"],
    ext_modules=[Extension("blockswap._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # setuptools' own build tree (copies of the Python files), apart from CMake's build/.
    options={"build": {"build_base": os.path.join("build-python", "torch-" + torch.__version__)}},
    python_requires=">=3.9",
    install_requires=[f"torch=={torch_version}"],
)
