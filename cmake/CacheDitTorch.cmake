# Finds the libtorch of the project's Python environment and defines
#   cache_dit::torch   INTERFACE IMPORTED: torch + c10 + c10_cuda includes and libraries
#
# The install is located through `torch.utils.cmake_prefix_path` of
# CACHE_DIT_PYTHON (default: <repo>/.venv/bin/python, else python3), but
# torch's own CMake package is not loaded: its targets drag in
# protobuf::libprotobuf (which collides with the system protobuf the gRPC
# targets use), CUDA::cuda_driver (the binaries must not link libcuda) and
# gencode flags of their own. The libraries below are what a kernel library
# or the dispatch layer needs, nothing more.
include_guard(GLOBAL)

if(NOT CACHE_DIT_PYTHON)
  if(EXISTS "${PROJECT_SOURCE_DIR}/.venv/bin/python")
    set(CACHE_DIT_PYTHON "${PROJECT_SOURCE_DIR}/.venv/bin/python" CACHE FILEPATH "" FORCE)
  else()
    find_program(_cache_dit_python3 python3 REQUIRED)
    set(CACHE_DIT_PYTHON "${_cache_dit_python3}" CACHE FILEPATH "" FORCE)
  endif()
endif()

execute_process(
  COMMAND "${CACHE_DIT_PYTHON}" -c
    "import torch, os; p = torch.utils.cmake_prefix_path; print(os.path.dirname(os.path.dirname(p))); print(torch.__version__); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or '')"
  OUTPUT_VARIABLE _cache_dit_torch_info
  RESULT_VARIABLE _cache_dit_torch_rc
  ERROR_VARIABLE _cache_dit_torch_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _cache_dit_torch_rc EQUAL 0)
  message(FATAL_ERROR "cache-dit-opd: cannot import torch with ${CACHE_DIT_PYTHON}: ${_cache_dit_torch_err}\n"
                      "Run deploy/install.sh or pass -DCACHE_DIT_PYTHON=<python with torch>.")
endif()
string(REPLACE "\n" ";" _cache_dit_torch_info "${_cache_dit_torch_info}")
list(GET _cache_dit_torch_info 0 CACHE_DIT_TORCH_ROOT)
list(GET _cache_dit_torch_info 1 CACHE_DIT_TORCH_VERSION)
list(GET _cache_dit_torch_info 2 _cache_dit_torch_abi)
list(GET _cache_dit_torch_info 3 CACHE_DIT_TORCH_CUDA)
message(STATUS "cache-dit-opd: torch ${CACHE_DIT_TORCH_VERSION} (CUDA ${CACHE_DIT_TORCH_CUDA}) at ${CACHE_DIT_TORCH_ROOT}")
if(CACHE_DIT_TORCH_CUDA STREQUAL "")
  message(FATAL_ERROR "cache-dit-opd: torch at ${CACHE_DIT_TORCH_ROOT} is a CPU-only build; the kernels need a CUDA build")
endif()

set(_lib "${CACHE_DIT_TORCH_ROOT}/lib")
add_library(cache_dit::torch INTERFACE IMPORTED GLOBAL)
target_include_directories(cache_dit::torch SYSTEM INTERFACE
  "${CACHE_DIT_TORCH_ROOT}/include"
  "${CACHE_DIT_TORCH_ROOT}/include/torch/csrc/api/include")
target_compile_definitions(cache_dit::torch INTERFACE
  _GLIBCXX_USE_CXX11_ABI=${_cache_dit_torch_abi}
  CACHE_DIT_TORCH_VERSION="${CACHE_DIT_TORCH_VERSION}")
# libtorch_cuda is linked even when no symbol of it is used (as torch's own
# CMake package does): its static initializers register the CUDA hooks and
# allocator, without which a program that is not Python fails at its first
# CUDA tensor ("dummyHasPrimaryContext: Should never been called").
target_link_libraries(cache_dit::torch INTERFACE
  "${_lib}/libtorch.so" "-Wl,--no-as-needed" "${_lib}/libtorch_cuda.so" "-Wl,--as-needed"
  "${_lib}/libtorch_cpu.so" "${_lib}/libc10_cuda.so" "${_lib}/libc10.so")
