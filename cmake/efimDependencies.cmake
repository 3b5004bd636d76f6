# Finds what efim::efim needs; shared by the build and by the installed package config.
find_package(Threads REQUIRED)
find_package(range-v3 CONFIG REQUIRED)

# xxHash is used header-only (XXH_INLINE_ALL), so only its include directory matters.
if(NOT TARGET efim::xxhash)
  find_path(EFIM_XXHASH_INCLUDE_DIR NAMES xxhash.h)
  if(NOT EFIM_XXHASH_INCLUDE_DIR)
    message(FATAL_ERROR "efim needs xxHash's header xxhash.h (Debian: apt-get install libxxhash-dev)")
  endif()
  add_library(efim::xxhash INTERFACE IMPORTED)
  set_target_properties(efim::xxhash PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${EFIM_XXHASH_INCLUDE_DIR}")
endif()

# Tokenizers: tokenizer.json is JSON (nlohmann_json), Unicode normalization and character
# categories come from ICU, and pre-tokenizer regexes run on Oniguruma, the engine Hugging Face
# tokenizers use, so that the same pattern splits text the same way.
find_package(nlohmann_json 3 REQUIRED)
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
