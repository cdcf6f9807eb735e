# Locates loom's dependencies the same way on Debian (system packages) and on a machine where
# some of them are unpacked into a private prefix (pass it in CMAKE_PREFIX_PATH).
find_package(Torch REQUIRED)

find_path(LOOM_BOOST_INCLUDE_DIR boost/dll/shared_library.hpp REQUIRED)
find_library(LOOM_BOOST_PROGRAM_OPTIONS NAMES boost_program_options REQUIRED)
find_path(LOOM_TOMLPP_INCLUDE_DIR toml++/toml.h REQUIRED)
find_package(spdlog REQUIRED)

# The hf-json tokenizer: PCRE2 runs tokenizer.json's Split regexes (Unicode classes, lookahead),
# ICU normalizes text (NFC for Qwen) and lowercases it, both reporting edits for exact offsets.
find_path(LOOM_PCRE2_INCLUDE_DIR pcre2.h REQUIRED)
find_library(LOOM_PCRE2_LIBRARY NAMES pcre2-8 REQUIRED)
add_library(loom_pcre2 INTERFACE)
target_include_directories(loom_pcre2 SYSTEM INTERFACE ${LOOM_PCRE2_INCLUDE_DIR})
target_link_libraries(loom_pcre2 INTERFACE ${LOOM_PCRE2_LIBRARY})

include(LoomFormatsDependencies)

# A CUDA build of LibTorch brings the CUDA runtime; loom then reports GPUs and their memory.
set(LOOM_WITH_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
  find_package(CUDAToolkit REQUIRED)
  set(LOOM_WITH_CUDA ON)
  # loom's own kernels (4-bit weights) are built for the GPUs LibTorch runs on.
  # The toolkit LibTorch was found with names its nvcc, whether or not it is on PATH.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS "${CUDAToolkit_NVCC_EXECUTABLE}")
    set(CMAKE_CUDA_COMPILER "${CUDAToolkit_NVCC_EXECUTABLE}" CACHE FILEPATH "nvcc")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(FATAL_ERROR "LibTorch is a CUDA build, so loom builds its CUDA kernels, but no CUDA compiler was found: "
                        "put nvcc on PATH or pass -DCMAKE_CUDA_COMPILER=/path/to/nvcc")
  endif()
  enable_language(CUDA)
  # Cubins for V100 (70), T4 (75), A100 (80), RTX 30 (86), RTX 40 / L4 (89), H100/H200 (90), and
  # compute_90 PTX that newer devices (Blackwell) JIT-compile. A toolkit that cannot build one (CUDA
  # 13 dropped Volta) leaves it out and says so; an explicit -DLOOM_CUDA_ARCHITECTURES is taken as given.
  if(NOT DEFINED CACHE{LOOM_CUDA_ARCHITECTURES})
    execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --list-gpu-arch OUTPUT_VARIABLE loom_nvcc_archs ERROR_QUIET RESULT_VARIABLE loom_nvcc_listed)
    set(loom_default_archs "")
    foreach(arch 70-real 75-real 80-real 86-real 89-real 90)
      string(REGEX REPLACE "-real$" "" number "${arch}")
      if(NOT loom_nvcc_listed EQUAL 0 OR loom_nvcc_archs MATCHES "compute_${number}")
        list(APPEND loom_default_archs ${arch})
      else()
        message(STATUS "loom: ${CMAKE_CUDA_COMPILER} cannot build compute capability ${number}: its kernels are left out of this build")
      endif()
    endforeach()
    set(LOOM_CUDA_ARCHITECTURES "${loom_default_archs}" CACHE STRING
        "GPU architectures loom's CUDA kernels are built for (V100 70, T4 75, A100 80, RTX 30 86, RTX 40 89, H100/H200 90; no -real: PTX too)")
  endif()
  message(STATUS "loom: CUDA kernels for ${LOOM_CUDA_ARCHITECTURES}")
endif()
message(STATUS "loom: LibTorch ${Torch_VERSION}, CUDA support: ${LOOM_WITH_CUDA}")

# c10d's NCCL process group header includes nccl.h, which a pip-installed LibTorch keeps in the
# nvidia-nccl wheel (pass LOOM_NCCL_ROOT, its folder holding include/ and lib/).
if(LOOM_WITH_CUDA)
  find_path(LOOM_NCCL_INCLUDE_DIR nccl.h HINTS ${LOOM_NCCL_ROOT}/include REQUIRED)
  find_library(LOOM_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${LOOM_NCCL_ROOT}/lib REQUIRED)
endif()

# c10d's Gloo process group (ranks on the CPU) is compiled into LibTorch, but its header includes
# Gloo's own headers (Debian: libgloo-dev; elsewhere unpack them into a prefix on
# CMAKE_PREFIX_PATH). Without them loom still runs several processes on GPUs (NCCL), and refuses
# CPU ranks with one line.
option(LOOM_USE_GLOO "Build c10d's Gloo process group (CPU ranks) when Gloo's headers are found" ON)
if(LOOM_USE_GLOO)
  find_path(LOOM_GLOO_INCLUDE_DIR gloo/algorithm.h)
endif()
if(LOOM_USE_GLOO AND LOOM_GLOO_INCLUDE_DIR)
  set(LOOM_WITH_GLOO ON)
else()
  set(LOOM_WITH_GLOO OFF)
  message(WARNING "loom: no Gloo headers (gloo/algorithm.h): processes on the CPU cannot talk to each other in this build")
endif()

# LibTorch 2.x wheels carry their own fmt headers in their include folder, and those would shadow
# the fmt spdlog was built against (spdlog 1.12 does not compile against fmt 12). A folder holding
# only spdlog's fmt goes first on the include path of the targets that log.
set(LOOM_FMT_FIRST_DIR "")
if(TARGET fmt::fmt)
  get_target_property(_loom_fmt_include fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
  foreach(_loom_torch_include IN LISTS TORCH_INCLUDE_DIRS)
    if(EXISTS "${_loom_torch_include}/fmt/core.h" AND NOT "${_loom_torch_include}" STREQUAL "${_loom_fmt_include}")
      set(LOOM_FMT_FIRST_DIR ${CMAKE_BINARY_DIR}/fmt-first)
      file(MAKE_DIRECTORY ${LOOM_FMT_FIRST_DIR})
      file(CREATE_LINK "${_loom_fmt_include}/fmt" "${LOOM_FMT_FIRST_DIR}/fmt" SYMBOLIC)
      message(STATUS "loom: LibTorch's fmt in ${_loom_torch_include} is shadowed by spdlog's in ${_loom_fmt_include}")
    endif()
  endforeach()
endif()
