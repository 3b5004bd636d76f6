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
