# LOOM_SANITIZE: everything built with AddressSanitizer and UndefinedBehaviorSanitizer;
# LOOM_BUILD_FUZZERS (clang) implies it. Included by loom's build and by the formats library's own.
if(LOOM_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "LOOM_BUILD_FUZZERS needs clang (libFuzzer): configure with CXX=clang++")
  endif()
  set(LOOM_SANITIZE ON)
  # Coverage for the fuzzers in every library they reach; the fuzzer's main only in their targets.
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()
if(LOOM_SANITIZE)
  # Any finding stops the process: a test or fuzz run fails instead of printing and going on.
  add_compile_options(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()
