# Run by CTest (tests/CMakeLists.txt): install, run the installed tool as installed (it finds
# its torch without LD_LIBRARY_PATH), then build and run an outside project.
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}")
  endif()
  message(STATUS "${out}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
if(EXISTS ${prefix}/bin/blockswap)
  # The build tree's copy is not on any path here: only the installed one can run.
  set(ENV{LD_LIBRARY_PATH} "")
  run(${prefix}/bin/blockswap run --mode train --blocks 4 --swap 2 --hidden 64 --heads 4
      --tokens 16 --steps 1 --json)
endif()
set(launcher "")
if(LAUNCHER)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()
run(${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix} -DTorch_DIR=${TORCH_DIR} ${launcher})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
