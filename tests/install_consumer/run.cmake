# Installs efim from the build tree into a fresh prefix, then configures, builds and runs a
# project that only knows that prefix.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}\n${out}")
  endif()
  message(STATUS "${out}")
endfunction()

run(${CMAKE_COMMAND} --install ${EFIM_BINARY_DIR} --prefix ${prefix})
# The dependencies where the project's build found them (empty on a machine with the Debian packages),
# through the environment (searched after -DCMAKE_PREFIX_PATH, so efim still comes from the prefix).
foreach(var PREFIX LIBRARY)
  if(DEPS_${var}_PATH)
    string(REPLACE "|" ":" paths "${DEPS_${var}_PATH}")
    set(ENV{CMAKE_${var}_PATH} "${paths}")
  endif()
endforeach()
set(extra)
if(POLICY_VERSION_MINIMUM)
  set(extra -DCMAKE_POLICY_VERSION_MINIMUM=${POLICY_VERSION_MINIMUM})
endif()
run(${CMAKE_COMMAND} -S ${EFIM_SOURCE_DIR}/tests/install_consumer -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release -DCONSUMER_CUDA=${CONSUMER_CUDA} ${extra})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
if(CONSUMER_CUDA)  # the same request on the GPU through efim::cuda (says so where there is no device)
  run(${WORK_DIR}/build/consumer_cuda)
endif()

# The package must come from the prefix, not from the source tree.
file(READ ${WORK_DIR}/build/CMakeCache.txt cache)
string(REGEX MATCH "efim_DIR:PATH=[^\n]*" efim_dir "${cache}")
if(NOT efim_dir MATCHES "^efim_DIR:PATH=${prefix}/")
  message(FATAL_ERROR "efim was not found in the install prefix: ${efim_dir}")
endif()
