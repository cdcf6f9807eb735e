# Registers loom_tests with CTest after each build: one CTest test per GoogleTest suite, so the
# ~0.9 s each process spends loading LibTorch is paid once a suite rather than once a test, and
# one per test for the suites named in ALONE (the slow ones, which -j 2 should spread over both
# cores) and for suites of one test. A grouped suite is named SUITE, a test alone SUITE.TEST.
#   cmake -DTEST_BINARY=... -DOUTPUT=... -DALONE=regex -DTIMEOUT=seconds -P ctest_groups.cmake
foreach(var TEST_BINARY OUTPUT ALONE TIMEOUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "ctest_groups.cmake: ${var} is not set")
  endif()
endforeach()

execute_process(COMMAND "${TEST_BINARY}" --gtest_list_tests
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE status TIMEOUT 60)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "ctest_groups.cmake: ${TEST_BINARY} --gtest_list_tests failed (${status}):\n${errors}")
endif()

# The listing: "Suite." at the line's start, then its tests indented by two spaces; either may end
# in "  # TypeParam = ..." or "  # GetParam() = ...".
string(REPLACE ";" "\\;" listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")
set(script "# Written by tests/ctest_groups.cmake after loom_tests was built.\n")
set(suite "")
set(suites "")
foreach(line IN LISTS lines)
  string(REGEX REPLACE "  #.*$" "" line "${line}")
  if(line MATCHES "^([^ ].*)\\.$")
    set(suite "${CMAKE_MATCH_1}")
    list(APPEND suites "${suite}")
    set(tests_of_${suite} "")
  elseif(line MATCHES "^  ([^ ]+)$" AND NOT suite STREQUAL "")
    list(APPEND tests_of_${suite} "${CMAKE_MATCH_1}")
  endif()
endforeach()
if(suites STREQUAL "")
  message(FATAL_ERROR "ctest_groups.cmake: ${TEST_BINARY} listed no tests")
endif()

set(names "")
foreach(suite IN LISTS suites)
  list(LENGTH tests_of_${suite} count)
  if(suite MATCHES "${ALONE}" OR count EQUAL 1)
    foreach(test IN LISTS tests_of_${suite})
      list(APPEND names "${suite}.${test}")
      string(APPEND script "add_test([=[${suite}.${test}]=] \"${TEST_BINARY}\" [=[--gtest_filter=${suite}.${test}]=])\n")
    endforeach()
  else()
    list(APPEND names "${suite}")
    string(APPEND script "add_test([=[${suite}]=] \"${TEST_BINARY}\" [=[--gtest_filter=${suite}.*]=])\n")
  endif()
endforeach()
foreach(name IN LISTS names)
  string(APPEND script "set_tests_properties([=[${name}]=] PROPERTIES FIXTURES_REQUIRED test_data TIMEOUT ${TIMEOUT})\n")
endforeach()
file(WRITE "${OUTPUT}.new" "${script}")
file(RENAME "${OUTPUT}.new" "${OUTPUT}")
