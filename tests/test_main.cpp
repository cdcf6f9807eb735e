// loom_tests' entry point: GoogleTest's, plus what CTest needs to know of the tests.
//   --loom-list-gpu-tests   prints the tests that need a CUDA device (LOOM_GPU_TEST), one a line
// A run whose every test skipped exits 77, which CTest reports as skipped rather than passed: a
// machine without a GPU says how many GPU tests it did not run, and why (each skip's message).
#include <gtest/gtest.h>

#include <cstring>
#include <iostream>

#include "test_support.hpp"

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--loom-list-gpu-tests") == 0) {
      for (const auto& name : loom::test::gpu_tests()) std::cout << name << "\n";
      return 0;
    }
  ::testing::InitGoogleTest(&argc, argv);
  const int status = RUN_ALL_TESTS();
  const auto& unit = *::testing::UnitTest::GetInstance();
  if (status == 0 && unit.test_to_run_count() > 0 && unit.skipped_test_count() == unit.test_to_run_count()) return loom::test::kAllSkipped;
  return status;
}
