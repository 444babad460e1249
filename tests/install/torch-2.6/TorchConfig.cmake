# A stand-in for torch 2.6's CMake package (tests/CMakeLists.txt, old_torch_test): blockswap's
# configure must stop with one clear message before anything compiles.
set(TORCH_FOUND TRUE)
set(TORCH_INSTALL_PREFIX ${CMAKE_CURRENT_LIST_DIR})
set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=0")
add_library(torch INTERFACE IMPORTED)
