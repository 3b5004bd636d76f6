# Installs efim from the build tree into a fresh prefix, then configures, builds and runs projects that
# only know that prefix: one program per layer linking that layer's target alone (core, cache and prompt,
# and the embedding examples, with ICU, Oniguruma and nlohmann_json made unfindable: the layers an
# embedder takes must not need them), then the whole library through efim::efim.
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

# Configures, builds and runs one consumer project in ${WORK_DIR}/${name}; the package must come from
# the prefix, not from the source tree.
function(consumer name)
  set(dir ${WORK_DIR}/${name})
  run(${CMAKE_COMMAND} -S ${EFIM_SOURCE_DIR}/tests/install_consumer -B ${dir} -G ${GENERATOR}
      -DCMAKE_PREFIX_PATH=${prefix} ${extra} ${ARGN})
  run(${CMAKE_COMMAND} --build ${dir} --parallel 2)
  file(READ ${dir}/CMakeCache.txt cache)
  string(REGEX MATCH "efim_DIR:PATH=[^\n]*" efim_dir "${cache}")
  if(NOT efim_dir MATCHES "^efim_DIR:PATH=${prefix}/")
    message(FATAL_ERROR "efim was not found in the install prefix: ${efim_dir}")
  endif()
  set(cache "${cache}" PARENT_SCOPE)
endfunction()

# The layers a runtime embeds without efim's tokenizers: found and linked with ICU, Oniguruma and
# nlohmann_json out of reach (find_package of either fails the configure), and no link line names them.
consumer(embedded -DCMAKE_BUILD_TYPE= -DCONSUMER_LAYERS=core,cache,prompt
         -DEMBED_EXAMPLES_DIR=${EFIM_SOURCE_DIR}/examples
         -DCMAKE_DISABLE_FIND_PACKAGE_ICU=ON -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON)
foreach(var ICU_INCLUDE_DIR ICU_UC_LIBRARY_RELEASE nlohmann_json_DIR EFIM_ONIGURUMA_LIBRARY)
  if(cache MATCHES "\n${var}:")
    message(FATAL_ERROR "the embedded layers' consumer looked for ${var}, which they do not need")
  endif()
endforeach()
# What every program of that project links (the Makefiles' link lines, or Ninja's build file).
file(GLOB_RECURSE link_files ${WORK_DIR}/embedded/link.txt ${WORK_DIR}/embedded/build.ninja)
if(NOT link_files)
  message(FATAL_ERROR "no link line found under ${WORK_DIR}/embedded")
endif()
foreach(f IN LISTS link_files)
  file(READ ${f} link)
  if(link MATCHES "icu|onig|nlohmann")
    message(FATAL_ERROR "a program of efim::core, efim::cache and efim::prompt links more than they need (${f}):\n${link}")
  endif()
endforeach()
foreach(program IN ITEMS consumer_core consumer_cache consumer_prompt embed_sessions embed_cache)
  run(${WORK_DIR}/embedded/${program})
endforeach()

# Every other layer alone, each with what its own headers need.
set(layers text kv kernels model engine server)
consumer(layers -DCMAKE_BUILD_TYPE= -DCONSUMER_LAYERS=text,kv,kernels,model,engine,server)
foreach(layer IN LISTS layers)
  run(${WORK_DIR}/layers/consumer_${layer})
endforeach()

# The whole library (and the CUDA backend's target where the toolkit is found).
consumer(whole -DCMAKE_BUILD_TYPE= -DCONSUMER_CUDA=${CONSUMER_CUDA})
run(${WORK_DIR}/whole/consumer)
if(CONSUMER_CUDA)  # the same request on the GPU through efim::cuda (says so where there is no device)
  run(${WORK_DIR}/whole/consumer_cuda)
endif()
