// The Python module's one translation unit: its sources, each small, compiled together, so that
// torch's and pybind11's headers are parsed once per build instead of once per source (20-30 s
// each: docs/build.md). The module compiles with hidden visibility, which rules out the
// library's precompiled header (Note [one C++ runtime per module] in CMakeLists.txt). A new
// source of the module is included here, not listed in CMakeLists.txt. (CMake's own unity
// build names each source by its absolute path, which a clone elsewhere would not find in
// ccache.)
#include "activations.cpp" // NOLINT(bugprone-suspicious-include)
#include "module.cpp"      // NOLINT(bugprone-suspicious-include)
#include "planner.cpp"     // NOLINT(bugprone-suspicious-include)
