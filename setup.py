"""pip install --no-build-isolation .  builds the Python package blockswap against the torch
that is installed (PyTorch's C++ extension convention: torch.utils.cpp_extension), torch 2.7 to
2.14. The built package requires exactly that torch and refuses another at import. The CUDA
backend is built in when that torch has CUDA and a CUDA toolkit is found."""

import glob
import os
import sys

from setuptools import setup

TORCH_MIN, TORCH_MAX = (2, 7), (2, 14)

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    sys.exit("blockswap compiles against the torch it will run with, and this build cannot see "
             "one (pip builds in an isolated environment unless told otherwise). Install torch "
             "2.7-2.14 first, then: pip install --no-build-isolation .")

torch_version = torch.__version__.split("+")[0]
if tuple(int(x) for x in torch_version.split(".")[:2]) < TORCH_MIN:
    sys.exit(f"blockswap needs torch {TORCH_MIN[0]}.{TORCH_MIN[1]} to "
             f"{TORCH_MAX[0]}.{TORCH_MAX[1]}; this is torch {torch.__version__}")

root = os.path.dirname(os.path.abspath(__file__))


def sources():
    files = sorted(glob.glob("src/core/*.cpp")) + ["src/device/device.cpp",
                                                   "src/device/host/emulated_device.cpp"]
    files += ["src/model_io/safetensors.cpp"]  # the file tier reads the model's header
    files += sorted(glob.glob("src/torch/*.cpp")) + ["python/src/module.cpp"]
    return files


define_macros = [("TORCH_EXTENSION_NAME", "_C")]
extension_sources = sources()
include_dirs = [os.path.join(root, "include"), os.path.join(root, ".deps", "include")]
libraries, library_dirs = [], []
cuda_home = cpp_extension.CUDA_HOME
if torch.version.cuda:
    # torch's current CUDA stream (src/torch/torch_compat.cpp) comes from c10_cuda.
    define_macros.append(("BLOCKSWAP_TORCH_CUDA", "1"))
    libraries.append("c10_cuda")
    if cuda_home and os.path.isdir(os.path.join(cuda_home, "include")):
        extension_sources.append("src/device/cuda/cuda_device.cpp")
        define_macros.append(("BLOCKSWAP_HAS_CUDA", "1"))
        include_dirs.append(os.path.join(cuda_home, "include"))
        libraries.append("cudart")
        library_dirs += [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]
    else:
        print("blockswap: WARNING: torch has CUDA but no CUDA toolkit was found (set CUDA_HOME): "
              "this build has no CUDA backend, and device='cuda' will raise", file=sys.stderr)

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
            # Note [one C++ runtime per module] in CMakeLists.txt.
            extra_link_args=["-Wl,--exclude-libs,ALL"],
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    # One build tree per torch, apart from CMake's build/: objects compiled against one torch
    # are never linked against another.
    options={"build": {"build_base": os.path.join("build-python", "torch-" + torch.__version__)}},
    python_requires=">=3.9",
    install_requires=[f"torch=={torch_version}"],
)
