"""pip install --no-build-isolation .  builds the Python package blockswap against the torch
that is installed (PyTorch's C++ extension convention: torch.utils.cpp_extension). The CUDA
backend is built in when that torch has CUDA and a CUDA toolkit is found."""

import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

import torch

root = os.path.dirname(os.path.abspath(__file__))


def sources():
    files = sorted(glob.glob("src/core/*.cpp")) + ["src/device/device.cpp",
                                                   "src/device/host/emulated_device.cpp"]
    files += sorted(glob.glob("src/torch/*.cpp")) + ["python/src/module.cpp"]
    return files


define_macros = [("TORCH_EXTENSION_NAME", "_C")]
extension_sources = sources()
include_dirs = [os.path.join(root, "include"), os.path.join(root, ".deps", "include")]
libraries, library_dirs = [], []
cuda_home = cpp_extension.CUDA_HOME
if torch.version.cuda and cuda_home and os.path.isdir(os.path.join(cuda_home, "include")):
    extension_sources.append("src/device/cuda/cuda_device.cpp")
    define_macros.append(("BLOCKSWAP_HAS_CUDA", "1"))
    include_dirs.append(os.path.join(cuda_home, "include"))
    libraries.append("cudart")
    library_dirs += [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]

setup(
    name="blockswap",
    version="0.1.0",
    description="Block swapping for models larger than device memory: a drop-in ModelOffloader",
    package_dir={"": "python"},
    packages=["blockswap"],
    ext_modules=[
        cpp_extension.CppExtension(
            "blockswap._C",
            extension_sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            libraries=libraries,
            library_dirs=library_dirs,
            extra_compile_args=["-std=c++20", "-O2"],
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.8",
    install_requires=["torch"],
)
