# Locates loom's dependencies the same way on Debian (system packages) and on a machine where
# some of them are unpacked into a private prefix (pass it in CMAKE_PREFIX_PATH).
find_package(Torch REQUIRED)

find_path(LOOM_BOOST_INCLUDE_DIR boost/dll/shared_library.hpp REQUIRED)
find_library(LOOM_BOOST_PROGRAM_OPTIONS NAMES boost_program_options REQUIRED)
find_path(LOOM_TOMLPP_INCLUDE_DIR toml++/toml.h REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json REQUIRED)

# A CUDA build of LibTorch brings the CUDA runtime; loom then reports GPUs and their memory.
set(LOOM_WITH_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
  find_package(CUDAToolkit REQUIRED)
  set(LOOM_WITH_CUDA ON)
endif()
message(STATUS "loom: LibTorch ${Torch_VERSION}, CUDA support: ${LOOM_WITH_CUDA}")
