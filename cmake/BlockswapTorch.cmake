# Which torch blockswap builds against, and the check that it is one blockswap supports.
#
# The torch is a Python package's (pip's wheels carry LibTorch, its CMake package and pybind11):
# BLOCKSWAP_TORCH_PYTHON names the Python whose torch it is. By default that is the project
# environment `.venv` that scripts/setup-deps makes, else a Python3_EXECUTABLE given on the
# command line, else `python3` on PATH; a Torch_DIR or CMAKE_PREFIX_PATH given by the caller is
# honoured as it is. The Python package (BLOCKSWAP_PYTHON) is built for that same Python.
#
# Supported: torch 2.7 (the first release whose pip wheels use the C++11 ABI) through 2.14. An
# older torch is a configure error; a newer one a warning.

set(BLOCKSWAP_TORCH_MIN 2.7)
set(BLOCKSWAP_TORCH_MAX 2.14)

if(NOT DEFINED BLOCKSWAP_TORCH_PYTHON)
  if(EXISTS ${PROJECT_SOURCE_DIR}/.venv/bin/python)
    set(blockswap_default_python ${PROJECT_SOURCE_DIR}/.venv/bin/python)
  elseif(DEFINED Python3_EXECUTABLE)
    set(blockswap_default_python ${Python3_EXECUTABLE})
  else()
    find_program(blockswap_default_python NAMES python3 python)
  endif()
  set(BLOCKSWAP_TORCH_PYTHON "${blockswap_default_python}" CACHE FILEPATH
      "The Python whose torch blockswap builds against (default: .venv/bin/python)")
endif()
if(BLOCKSWAP_TORCH_PYTHON AND NOT IS_ABSOLUTE "${BLOCKSWAP_TORCH_PYTHON}")
  find_program(blockswap_torch_python_path "${BLOCKSWAP_TORCH_PYTHON}")
  if(blockswap_torch_python_path)
    set(BLOCKSWAP_TORCH_PYTHON "${blockswap_torch_python_path}")
  endif()
endif()

# blockswap_torch_python_query(OUT CODE): runs CODE in BLOCKSWAP_TORCH_PYTHON with torch
# imported; OUT is its output, or empty when that Python has no torch.
function(blockswap_torch_python_query out code)
  set(${out} "" PARENT_SCOPE)
  if(NOT BLOCKSWAP_TORCH_PYTHON OR NOT EXISTS "${BLOCKSWAP_TORCH_PYTHON}")
    return()
  endif()
  execute_process(COMMAND ${BLOCKSWAP_TORCH_PYTHON} -W ignore -c "import torch; ${code}"
                  OUTPUT_VARIABLE result OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE failed ERROR_QUIET)
  if(failed EQUAL 0)
    set(${out} "${result}" PARENT_SCOPE)
  endif()
endfunction()

blockswap_torch_python_query(blockswap_torch_prefix "print(torch.utils.cmake_prefix_path)")
if(blockswap_torch_prefix AND NOT Torch_DIR)
  list(APPEND CMAKE_PREFIX_PATH ${blockswap_torch_prefix})
endif()

# blockswap_check_torch_version(VERSION WHERE): the one message for a torch out of range.
function(blockswap_check_torch_version version where)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" major_minor "${version}")
  if(major_minor VERSION_LESS BLOCKSWAP_TORCH_MIN)
    message(FATAL_ERROR
      "blockswap needs torch ${BLOCKSWAP_TORCH_MIN} to ${BLOCKSWAP_TORCH_MAX}; ${where} is "
      "torch ${version}. Run scripts/setup-deps (it makes .venv with torch 2.13.0), or point "
      "-DBLOCKSWAP_TORCH_PYTHON=/path/to/python at a Python with a supported torch.")
  elseif(major_minor VERSION_GREATER BLOCKSWAP_TORCH_MAX)
    message(WARNING "blockswap is tested with torch ${BLOCKSWAP_TORCH_MIN} to "
                    "${BLOCKSWAP_TORCH_MAX}; ${where} is torch ${version}")
  endif()
endfunction()

find_package(Torch REQUIRED)
blockswap_check_torch_version("${Torch_VERSION}" "${TORCH_INSTALL_PREFIX}")
# torch's CMake package looks for its libraries in the system's directories before its own: with
# another LibTorch installed there (Debian's libtorch-dev) it would link that one's.
get_filename_component(blockswap_torch_library_dir "${TORCH_LIBRARY}" DIRECTORY)
get_filename_component(blockswap_torch_library_dir "${blockswap_torch_library_dir}" REALPATH)
get_filename_component(blockswap_torch_prefix_dir "${TORCH_INSTALL_PREFIX}" REALPATH)
string(FIND "${blockswap_torch_library_dir}" "${blockswap_torch_prefix_dir}" blockswap_at)
if(NOT blockswap_at EQUAL 0)
  message(FATAL_ERROR
    "torch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} would link another LibTorch's library, "
    "${TORCH_LIBRARY} (torch's CMake package searches the system's directories first). Remove "
    "that LibTorch (Debian: apt-get remove libtorch-dev libtorch1.13), or configure in a fresh "
    "build directory with -DTORCH_LIBRARY=${TORCH_INSTALL_PREFIX}/lib/libtorch.so and the same "
    "for c10 and torch_cpu.")
endif()
# torch's ABI flag (-D_GLIBCXX_USE_CXX11_ABI) reaches only targets that link torch; every
# blockswap target and GoogleTest get it too, so that their std::string symbols match.
add_compile_options(${TORCH_CXX_FLAGS})
# Whether this torch has CUDA (its c10_cuda library): the torch CUDA-stream integration needs it.
if(TARGET c10_cuda OR EXISTS ${TORCH_INSTALL_PREFIX}/lib/libc10_cuda.so)
  set(BLOCKSWAP_TORCH_HAS_CUDA ON)
  find_library(BLOCKSWAP_C10_CUDA_LIBRARY c10_cuda HINTS ${TORCH_INSTALL_PREFIX}/lib NO_DEFAULT_PATH)
else()
  set(BLOCKSWAP_TORCH_HAS_CUDA OFF)
endif()
message(STATUS "blockswap: torch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} "
               "(CUDA: ${BLOCKSWAP_TORCH_HAS_CUDA})")
