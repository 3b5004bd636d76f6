# Finds what efim's layers need; shared by the build and by the installed package config.
# EFIM_DEPENDENCY_LAYERS names the layers asked for (their own outside libraries are found; the layers
# they build on must be in the list too); unset: every layer.
if(NOT DEFINED EFIM_DEPENDENCY_LAYERS)
  set(EFIM_DEPENDENCY_LAYERS core cache prompt text kv kernels model engine server)
endif()

# core: threads (the thread pool).
find_package(Threads REQUIRED)

# cache (and text, model, through cache/xxhash.hpp): xxHash, used header-only (XXH_INLINE_ALL), so
# only its include directory matters.
if(NOT TARGET efim::xxhash AND ("cache" IN_LIST EFIM_DEPENDENCY_LAYERS OR "text" IN_LIST EFIM_DEPENDENCY_LAYERS))
  find_path(EFIM_XXHASH_INCLUDE_DIR NAMES xxhash.h)
  if(NOT EFIM_XXHASH_INCLUDE_DIR)
    message(FATAL_ERROR "efim needs xxHash's header xxhash.h (Debian: apt-get install libxxhash-dev)")
  endif()
  add_library(efim::xxhash INTERFACE IMPORTED)
  set_target_properties(efim::xxhash PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${EFIM_XXHASH_INCLUDE_DIR}")
endif()

# text (tokenizers): tokenizer.json is JSON (nlohmann_json), Unicode normalization and character
# categories come from ICU, and pre-tokenizer regexes run on Oniguruma, the engine Hugging Face
# tokenizers use, so that the same pattern splits text the same way. server: JSON bodies.
if("text" IN_LIST EFIM_DEPENDENCY_LAYERS OR "server" IN_LIST EFIM_DEPENDENCY_LAYERS)
  find_package(nlohmann_json 3 REQUIRED)
endif()
if("text" IN_LIST EFIM_DEPENDENCY_LAYERS)
  find_package(ICU REQUIRED COMPONENTS uc)
  if(NOT TARGET efim::oniguruma)
    find_path(EFIM_ONIGURUMA_INCLUDE_DIR NAMES oniguruma.h)
    find_library(EFIM_ONIGURUMA_LIBRARY NAMES onig)
    if(NOT EFIM_ONIGURUMA_INCLUDE_DIR OR NOT EFIM_ONIGURUMA_LIBRARY)
      message(FATAL_ERROR "efim needs Oniguruma (Debian: apt-get install libonig-dev)")
    endif()
    add_library(efim::oniguruma UNKNOWN IMPORTED)
    set_target_properties(efim::oniguruma PROPERTIES
      IMPORTED_LOCATION "${EFIM_ONIGURUMA_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${EFIM_ONIGURUMA_INCLUDE_DIR}")
  endif()
endif()
