# Declares the project's targets in a few lines each, in the manner of
# abseil's absl_cc_library / absl_cc_test.
#
#   opd_cc_library(NAME opd_session
#                  [INTERFACE | SHARED]          # default: STATIC
#                  [SIDE plain | torch | grpc]   # default: plain
#                  [PLAIN_INTERFACE]             # its headers are plain: the
#                                                # side's deps are PRIVATE
#                  HDRS session.h ...            # public headers (layer-checked)
#                  SRCS session.cc ...
#                  DEPS opd_common ...           # PUBLIC
#                  PRIVATE_DEPS spdlog::spdlog   # PRIVATE
#                  DEFINES FOO=1)                # PRIVATE compile definitions
#
#   opd_cc_test(NAME opd_server_tests
#               SRCS executor_test.cc ...
#               DEPS opd_exec ...
#               PREFIX "server."                 # ctest name prefix
#               [LABELS gpu server] [TIMEOUT 60] [NO_MAIN] [RUN_SERIAL] [SIDE ...])
#
# Every target gets the project's warnings (-Wall -Wextra; -Werror when
# CACHE_DIT_WERROR is ON, as tests/run.sh builds it), the repository root as
# include root (so includes read "common/status.h") and an alias
# cache_dit_opd::<NAME>. Two rules are enforced at configure time:
#
#   SIDE   torch's include directory ships its own google/protobuf and fmt
#          headers, so no translation unit may see torch's headers and gRPC's
#          (or protobuf's, or spdlog's). A target's sources see its SIDE; it
#          may depend only on targets that expose plain headers or its own
#          side. A torch- or grpc-side target with PLAIN_INTERFACE exposes
#          plain headers (the dispatch layer: its header is plain C++, torch is
#          PRIVATE), so the other side can link it.
#   LAYER  a target in folder F may include project headers only from the
#          folders F may stand on: proto/ (the contract) <- common/ <-
#          kernels/ | server/ | client/ <- admin/ (on client/, never on
#          server/: an operator's tool is a client); client/ stands on
#          kernels/ too (the op checks, for its native functional
#          overloads); tests/, bench/ and tools/ may include anything.
#          Includes of the contract ("cache_dit_opd/v1/...") are allowed
#          everywhere. Checked over HDRS and SRCS.
include_guard(GLOBAL)

# Which headers an imported dependency exposes (for the SIDE rule).
function(opd_mark_side side)
  foreach(_t IN LISTS ARGN)
    if(TARGET ${_t})
      get_target_property(_aliased ${_t} ALIASED_TARGET)
      if(_aliased)
        set(_t ${_aliased})
      endif()
      set_target_properties(${_t} PROPERTIES OPD_EXPOSED_SIDE ${side})
    endif()
  endforeach()
endfunction()

option(CACHE_DIT_WERROR "Treat warnings in the project's own code as errors" OFF)

# Sanitizers (tests/run.sh step 5 builds the C++ suites with address,undefined): every
# C and C++ translation unit of the project is instrumented, and every C/C++
# link gets the runtime. CUDA device code is not instrumented, and a target
# linked by nvcc (the kernel library) gets no runtime of its own: its
# instrumented host objects resolve it from the executable that loads it.
set(CACHE_DIT_SANITIZE "" CACHE STRING
    "Sanitizers for the project's C/C++, as -fsanitize= takes them: address,undefined or thread; empty: none")
if(CACHE_DIT_SANITIZE)
  set(_opd_san -fsanitize=${CACHE_DIT_SANITIZE} -fno-omit-frame-pointer -g)
  if(CACHE_DIT_SANITIZE MATCHES "undefined")
    list(APPEND _opd_san -fno-sanitize-recover=undefined)  # a finding fails the test
    list(APPEND _opd_san -DCACHE_DIT_UBSAN=1)               # for the one test UBSan's runtime breaks
  endif()
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    # GCC 12 warns about its own instrumented std::vector code at -O3
    # ("writing 1 byte into a region of size 0"): not our code.
    list(APPEND _opd_san -Wno-stringop-overflow)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${_opd_san}>")
  add_link_options("$<$<LINK_LANGUAGE:C,CXX>:-fsanitize=${CACHE_DIT_SANITIZE}>")
  message(STATUS "cache-dit-opd: sanitizers ${CACHE_DIT_SANITIZE}")
endif()

set(_OPD_PROJECT_FOLDERS common kernels server client admin tests bench tools proto)
set(_OPD_LAYER_common common)
set(_OPD_LAYER_kernels kernels)
set(_OPD_LAYER_server common server)
set(_OPD_LAYER_client common kernels client)
set(_OPD_LAYER_admin common client admin)
set(_OPD_LAYER_proto "")

# The project's warning flags for `target`'s C++ sources. CUDA sources keep
# the flags their folder sets (nvcc's host pass warns in generated code).
function(opd_target_warnings target)
  set(_cxx -Wall -Wextra)
  if(CACHE_DIT_WERROR)
    list(APPEND _cxx -Werror)
  endif()
  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "INTERFACE_LIBRARY")
    return()
  endif()
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${_cxx}>)
endfunction()

# Fails the configure step when a source of `target` includes a project
# folder its own folder may not stand on (see LAYER above).
function(_opd_check_layer target)
  file(RELATIVE_PATH _rel "${PROJECT_SOURCE_DIR}" "${CMAKE_CURRENT_SOURCE_DIR}")
  string(REGEX MATCH "^[^/]+" _folder "${_rel}")
  if(NOT DEFINED _OPD_LAYER_${_folder})
    return()  # tests/, bench/, tools/: anything goes
  endif()
  set(_allowed ${_OPD_LAYER_${_folder}})
  foreach(_src IN LISTS ARGN)
    if(NOT IS_ABSOLUTE "${_src}")
      set(_src "${CMAKE_CURRENT_SOURCE_DIR}/${_src}")
    endif()
    if(NOT EXISTS "${_src}")
      continue()  # generated
    endif()
    file(STRINGS "${_src}" _includes REGEX "^#include \"[a-z_]+/")
    foreach(_line IN LISTS _includes)
      string(REGEX REPLACE "^#include \"([a-z_]+)/.*" "\\1" _inc "${_line}")
      if(_inc IN_LIST _OPD_PROJECT_FOLDERS AND NOT _inc IN_LIST _allowed)
        file(RELATIVE_PATH _src_rel "${PROJECT_SOURCE_DIR}" "${_src}")
        message(FATAL_ERROR "cache-dit-opd: ${_src_rel} (target ${target}, folder ${_folder}/) includes "
                            "${_inc}/, which ${_folder}/ may not depend on (allowed: ${_allowed})")
      endif()
    endforeach()
  endforeach()
endfunction()

# Fails when `target`, whose sources see `side`, depends on a project target
# that exposes another side's headers (a plain target may use plain ones only).
function(_opd_check_side target side)
  foreach(_dep IN LISTS ARGN)
    if(NOT TARGET ${_dep})
      continue()
    endif()
    get_target_property(_aliased ${_dep} ALIASED_TARGET)
    if(_aliased)
      set(_dep ${_aliased})
    endif()
    get_target_property(_exposed ${_dep} OPD_EXPOSED_SIDE)
    if(NOT _exposed OR _exposed STREQUAL "plain" OR _exposed STREQUAL side)
      continue()
    endif()
    message(FATAL_ERROR "cache-dit-opd: ${target} (${side} side) depends on ${_dep}, which exposes "
                        "${_exposed}-side headers; torch-side and grpc-side headers never meet")
  endforeach()
endfunction()

function(opd_cc_library)
  cmake_parse_arguments(OPD "INTERFACE;SHARED;PLAIN_INTERFACE" "NAME;SIDE" "HDRS;SRCS;DEPS;PRIVATE_DEPS;DEFINES" ${ARGN})
  if(NOT OPD_SIDE)
    set(OPD_SIDE plain)
  endif()
  _opd_check_layer(${OPD_NAME} ${OPD_HDRS} ${OPD_SRCS})
  _opd_check_side(${OPD_NAME} ${OPD_SIDE} ${OPD_DEPS} ${OPD_PRIVATE_DEPS})
  if(OPD_INTERFACE)
    add_library(${OPD_NAME} INTERFACE)
    target_include_directories(${OPD_NAME} INTERFACE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${OPD_NAME} INTERFACE ${OPD_DEPS})
  else()
    if(OPD_SHARED)
      add_library(${OPD_NAME} SHARED ${OPD_SRCS} ${OPD_HDRS})
    else()
      add_library(${OPD_NAME} STATIC ${OPD_SRCS} ${OPD_HDRS})
    endif()
    target_include_directories(${OPD_NAME} PUBLIC ${PROJECT_SOURCE_DIR})
    target_link_libraries(${OPD_NAME} PUBLIC ${OPD_DEPS} PRIVATE ${OPD_PRIVATE_DEPS})
    target_compile_definitions(${OPD_NAME} PRIVATE ${OPD_DEFINES})
    opd_target_warnings(${OPD_NAME})
  endif()
  set(_exposed ${OPD_SIDE})
  if(OPD_PLAIN_INTERFACE)
    set(_exposed plain)
  endif()
  set_target_properties(${OPD_NAME} PROPERTIES OPD_EXPOSED_SIDE ${_exposed})
  add_library(cache_dit_opd::${OPD_NAME} ALIAS ${OPD_NAME})
endfunction()

function(opd_cc_test)
  cmake_parse_arguments(OPD "NO_MAIN;RUN_SERIAL" "NAME;PREFIX;TIMEOUT;SIDE" "SRCS;DEPS;LABELS;DEFINES" ${ARGN})
  if(NOT OPD_SIDE)
    set(OPD_SIDE plain)
  endif()
  if(NOT OPD_TIMEOUT)
    set(OPD_TIMEOUT 60)
  endif()
  _opd_check_side(${OPD_NAME} ${OPD_SIDE} ${OPD_DEPS})
  add_executable(${OPD_NAME} ${OPD_SRCS})
  target_include_directories(${OPD_NAME} PRIVATE ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  if(OPD_NO_MAIN)
    target_link_libraries(${OPD_NAME} PRIVATE ${OPD_DEPS} GTest::gtest)
  else()
    target_link_libraries(${OPD_NAME} PRIVATE ${OPD_DEPS} GTest::gtest_main)
  endif()
  target_compile_definitions(${OPD_NAME} PRIVATE ${OPD_DEFINES})
  opd_target_warnings(${OPD_NAME})
  # A test on the GPU runs alone (ctest -j runs the others in parallel):
  # its timing, stall and memory checks assume the device is its own.
  set(_serial FALSE)
  if(OPD_RUN_SERIAL OR "gpu" IN_LIST OPD_LABELS)
    set(_serial TRUE)
  endif()
  # PRE_TEST: listing the tests runs the binary, which for torch-side suites
  # loads libtorch (seconds); doing it when ctest runs keeps builds fast.
  gtest_discover_tests(${OPD_NAME} TEST_PREFIX "${OPD_PREFIX}" DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 120
                       PROPERTIES LABELS "${OPD_LABELS}" TIMEOUT ${OPD_TIMEOUT} RUN_SERIAL ${_serial})
endfunction()
