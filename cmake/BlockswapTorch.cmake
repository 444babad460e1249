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
  set(BLOCKSWAP_TORCH_PYTHON_DEFAULTED ON CACHE INTERNAL "")
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

# What that torch is, asked of torch itself before anything reads its files: version, install
# directory, the CUDA it was built with, its C++ ABI.
# A Python named on the command line that is not there, or has no torch, is the caller's
# mistake, not a reason to look elsewhere (a default one without torch leaves the LibTorch of
# CMAKE_PREFIX_PATH to be found).
if(BLOCKSWAP_TORCH_PYTHON AND NOT Torch_DIR AND NOT BLOCKSWAP_TORCH_PYTHON_DEFAULTED)
  if(NOT EXISTS "${BLOCKSWAP_TORCH_PYTHON}")
    message(FATAL_ERROR "BLOCKSWAP_TORCH_PYTHON=${BLOCKSWAP_TORCH_PYTHON}: no such program. Name "
                        "the Python whose torch blockswap builds against, or run "
                        "scripts/setup-deps (it makes .venv with torch 2.13.0).")
  endif()
  execute_process(COMMAND ${BLOCKSWAP_TORCH_PYTHON} -c "import torch"
                  RESULT_VARIABLE blockswap_no_torch OUTPUT_QUIET ERROR_VARIABLE blockswap_why)
  if(blockswap_no_torch)
    string(STRIP "${blockswap_why}" blockswap_why)
    string(REGEX MATCH "[^\n]*$" blockswap_why "${blockswap_why}")
    message(FATAL_ERROR "BLOCKSWAP_TORCH_PYTHON=${BLOCKSWAP_TORCH_PYTHON} cannot import torch "
                        "(${blockswap_why}): install torch 2.7-2.14 there, or name another Python.")
  endif()
endif()
blockswap_torch_python_query(blockswap_torch_info
  "import os; print(';'.join([torch.__version__.split('+')[0], os.path.dirname(torch.__file__), torch.version.cuda or '', str(int(torch._C._GLIBCXX_USE_CXX11_ABI))]))")

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

# blockswap_find_cuda_runtime(MAJOR ROOTS...): the CUDA runtime (cuda_runtime_api.h and
# libcudart) of major version MAJOR (any, when empty) in the first of ROOTS that has one. Sets
# BLOCKSWAP_CUDA_RUNTIME_INCLUDE, BLOCKSWAP_CUDA_RUNTIME_LIBRARY, BLOCKSWAP_CUDA_RUNTIME_VERSION
# (13.0) and BLOCKSWAP_CUDA_RUNTIME_SEEN (what was passed over, for the message).
function(blockswap_find_cuda_runtime major)
  set(seen "")
  foreach(root ${ARGN})
    set(header ${root}/include/cuda_runtime_api.h)
    if(NOT EXISTS ${header})
      continue()
    endif()
    # pip's runtime packages carry cuda_runtime_api.h without the crt/ headers it includes:
    # those come with nvidia-cuda-crt (CUDA 13, into the same folder) or nvidia-cuda-nvcc-cu12
    # (CUDA 12, beside it). A root without them cannot compile.
    set(includes ${root}/include)
    if(NOT EXISTS ${root}/include/crt/host_defines.h)
      if(EXISTS ${root}/../cuda_nvcc/include/crt/host_defines.h)
        get_filename_component(crt ${root}/../cuda_nvcc/include REALPATH)
        list(APPEND includes ${crt})
      else()
        list(APPEND seen "${root} (no include/crt/host_defines.h)")
        continue()
      endif()
    endif()
    file(STRINGS ${header} line REGEX "^#define CUDART_VERSION +[0-9]+")
    string(REGEX MATCH "[0-9]+$" number "${line}")
    math(EXPR found_major "${number} / 1000")
    math(EXPR found_minor "(${number} % 1000) / 10")
    if(major AND NOT found_major EQUAL major)
      list(APPEND seen "CUDA ${found_major}.${found_minor} at ${root}")
      continue()
    endif()
    find_library(library NAMES cudart libcudart.so.${found_major}
                 HINTS ${root}/lib64 ${root}/lib NO_DEFAULT_PATH NO_CACHE)
    if(library)
      set(BLOCKSWAP_CUDA_RUNTIME_INCLUDE ${includes} PARENT_SCOPE)
      set(BLOCKSWAP_CUDA_RUNTIME_LIBRARY ${library} PARENT_SCOPE)
      set(BLOCKSWAP_CUDA_RUNTIME_VERSION ${found_major}.${found_minor} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(BLOCKSWAP_CUDA_RUNTIME_SEEN "${seen}" PARENT_SCOPE)
endfunction()

# The CUDA toolkits on this machine, in the order a user would expect them to be taken.
set(blockswap_cuda_toolkits ${CUDAToolkit_ROOT} ${CUDA_TOOLKIT_ROOT_DIR} $ENV{CUDA_HOME}
                            $ENV{CUDA_PATH})
find_program(blockswap_nvcc nvcc NO_CACHE)
if(blockswap_nvcc)
  get_filename_component(blockswap_nvcc "${blockswap_nvcc}" REALPATH)
  get_filename_component(blockswap_nvcc_root "${blockswap_nvcc}" DIRECTORY)
  get_filename_component(blockswap_nvcc_root "${blockswap_nvcc_root}" DIRECTORY)
  list(APPEND blockswap_cuda_toolkits ${blockswap_nvcc_root})
endif()
file(GLOB blockswap_usr_local_cuda LIST_DIRECTORIES true /usr/local/cuda-*)
list(APPEND blockswap_cuda_toolkits /usr/local/cuda ${blockswap_usr_local_cuda})

# A Torch_DIR that names the Python's own torch (a build directory configured before) is that
# torch; another one is a LibTorch of the caller's.
if(blockswap_torch_info)
  list(GET blockswap_torch_info 1 blockswap_dir)
  if(Torch_DIR STREQUAL "${blockswap_dir}/share/cmake/Torch")
    unset(Torch_DIR CACHE)
    unset(Torch_DIR)
  endif()
endif()
if(blockswap_torch_info AND NOT Torch_DIR)
  # Note [torch from its Python package]: the torch target is made from the wheel's own layout
  # (headers, libraries, the definitions its CMake package records), not by torch's CMake
  # package: that package insists on a full CUDA toolkit (nvcc) for a CUDA torch, which most
  # machines with a CUDA torch do not have, and reads the files before anything could check the
  # version. blockswap needs only the CUDA runtime, and takes the one torch itself loads.
  list(GET blockswap_torch_info 0 Torch_VERSION)
  list(GET blockswap_torch_info 1 TORCH_INSTALL_PREFIX)
  list(GET blockswap_torch_info 2 blockswap_torch_cuda)
  list(GET blockswap_torch_info 3 blockswap_torch_abi)
  blockswap_check_torch_version("${Torch_VERSION}" "${BLOCKSWAP_TORCH_PYTHON}'s")
  set(Torch_DIR ${TORCH_INSTALL_PREFIX}/share/cmake/Torch)
  set(blockswap_torch_lib ${TORCH_INSTALL_PREFIX}/lib)
  foreach(name torch torch_cpu c10)
    if(NOT EXISTS ${blockswap_torch_lib}/lib${name}.so)
      message(FATAL_ERROR "torch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} has no "
                          "lib/lib${name}.so: a torch wheel carries LibTorch; reinstall torch")
    endif()
  endforeach()
  set(TORCH_LIBRARY ${blockswap_torch_lib}/libtorch.so)
  # The definitions torch's own targets carry (which parts of torch.distributed it has).
  file(STRINGS ${TORCH_INSTALL_PREFIX}/share/cmake/Caffe2/Caffe2Targets.cmake blockswap_lines
       REGEX "INTERFACE_COMPILE_DEFINITIONS \"[A-Za-z0-9_;=]+\"")
  set(blockswap_torch_definitions "")
  foreach(line ${blockswap_lines})
    string(REGEX MATCH "\"[A-Za-z0-9_;=]+\"" defs "${line}")
    string(REPLACE "\"" "" defs "${defs}")
    list(APPEND blockswap_torch_definitions ${defs})
  endforeach()
  list(REMOVE_DUPLICATES blockswap_torch_definitions)
  # torch_cpu (and torch_cuda) register their operators when loaded: linked even where no
  # symbol of theirs is called, as torch's own targets do.
  set(blockswap_torch_link ${TORCH_LIBRARY}
      "-Wl,--no-as-needed,${blockswap_torch_lib}/libtorch_cpu.so,--as-needed")
  set(BLOCKSWAP_TORCH_HAS_CUDA OFF)
  if(blockswap_torch_cuda)
    # The runtime torch loads: pip's nvidia package beside torch (its layout per CUDA major),
    # then a toolkit of the same major.
    string(REGEX MATCH "^[0-9]+" blockswap_torch_cuda_major "${blockswap_torch_cuda}")
    get_filename_component(blockswap_site "${TORCH_INSTALL_PREFIX}" DIRECTORY)
    blockswap_find_cuda_runtime(${blockswap_torch_cuda_major}
      ${blockswap_site}/nvidia/cu${blockswap_torch_cuda_major} ${blockswap_site}/nvidia/cuda_runtime
      ${blockswap_cuda_toolkits})
    if(BLOCKSWAP_CUDA_RUNTIME_LIBRARY)
      set(BLOCKSWAP_TORCH_HAS_CUDA ON)
      set(BLOCKSWAP_C10_CUDA_LIBRARY ${blockswap_torch_lib}/libc10_cuda.so)
      list(APPEND blockswap_torch_link
           "-Wl,--no-as-needed,${blockswap_torch_lib}/libtorch_cuda.so,--as-needed"
           ${BLOCKSWAP_C10_CUDA_LIBRARY} ${BLOCKSWAP_CUDA_RUNTIME_LIBRARY})
    else()
      string(REPLACE ";" ", " blockswap_seen "${BLOCKSWAP_CUDA_RUNTIME_SEEN}")
      set(blockswap_crt_package nvidia-cuda-crt)
      if(blockswap_torch_cuda_major LESS 13)
        set(blockswap_crt_package nvidia-cuda-nvcc-cu${blockswap_torch_cuda_major})
      endif()
      message(WARNING
        "torch ${Torch_VERSION} was built with CUDA ${blockswap_torch_cuda}, and no CUDA "
        "${blockswap_torch_cuda_major} runtime that compiles was found (beside torch, in pip's "
        "nvidia packages, or in a toolkit; passed over: ${blockswap_seen}): blockswap is built "
        "WITHOUT its CUDA backend, and device='cuda' raises. Set CUDA_HOME to a CUDA "
        "${blockswap_torch_cuda_major} toolkit, or complete pip's runtime beside torch with its "
        "crt headers (pip install ${blockswap_crt_package}==${blockswap_torch_cuda}.*), and build "
        "again. A toolkit of another major is never taken: it would put two CUDA runtimes in one "
        "process.")
    endif()
  endif()
  list(APPEND blockswap_torch_link ${blockswap_torch_lib}/libc10.so)
  add_library(torch INTERFACE IMPORTED GLOBAL)
  set_target_properties(torch PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES
      "${TORCH_INSTALL_PREFIX}/include;${TORCH_INSTALL_PREFIX}/include/torch/csrc/api/include"
    INTERFACE_COMPILE_DEFINITIONS "${blockswap_torch_definitions}"
    INTERFACE_LINK_LIBRARIES "${blockswap_torch_link}")
  set(TORCH_CXX_FLAGS -D_GLIBCXX_USE_CXX11_ABI=${blockswap_torch_abi})
else()
  if(blockswap_torch_info)
    list(GET blockswap_torch_info 0 blockswap_version)
    blockswap_check_torch_version("${blockswap_version}" "${BLOCKSWAP_TORCH_PYTHON}'s")
  endif()
  # A LibTorch given by Torch_DIR or CMAKE_PREFIX_PATH: torch's own CMake package (it finds a
  # CUDA toolkit itself for a CUDA LibTorch).
  find_package(Torch REQUIRED)
  blockswap_check_torch_version("${Torch_VERSION}" "${TORCH_INSTALL_PREFIX}")
  # torch's CMake package looks for its libraries in the system's directories before its own:
  # with another LibTorch installed there (Debian's libtorch-dev) it would link that one's.
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
  set(BLOCKSWAP_TORCH_HAS_CUDA OFF)
  if(TARGET c10_cuda OR EXISTS ${TORCH_INSTALL_PREFIX}/lib/libc10_cuda.so)
    # The toolkit torch's package took.
    blockswap_find_cuda_runtime("${CUDAToolkit_VERSION_MAJOR}" ${CUDAToolkit_LIBRARY_ROOT}
                                ${blockswap_cuda_toolkits})
    if(BLOCKSWAP_CUDA_RUNTIME_LIBRARY)
      set(BLOCKSWAP_TORCH_HAS_CUDA ON)
      find_library(BLOCKSWAP_C10_CUDA_LIBRARY c10_cuda HINTS ${TORCH_INSTALL_PREFIX}/lib
                   NO_DEFAULT_PATH)
    endif()
  endif()
endif()
# torch's ABI flag (-D_GLIBCXX_USE_CXX11_ABI) reaches only targets that link torch; every
# blockswap target and GoogleTest get it too, so that their std::string symbols match.
add_compile_options(${TORCH_CXX_FLAGS})
set(blockswap_cuda_note "no")
if(BLOCKSWAP_TORCH_HAS_CUDA)
  set(blockswap_cuda_note "runtime ${BLOCKSWAP_CUDA_RUNTIME_VERSION} at ${BLOCKSWAP_CUDA_RUNTIME_LIBRARY}")
endif()
message(STATUS "blockswap: torch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX} "
               "(CUDA: ${blockswap_cuda_note})")
