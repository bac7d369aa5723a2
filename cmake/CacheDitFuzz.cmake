# Coverage-guided fuzzing (libFuzzer) of every parser of bytes a client
# controls: tests/fuzz/ (its README.md says what each target checks;
# tests/fuzz/run.sh builds and runs them).
#
#   CACHE_DIT_FUZZ=ON  needs clang (libFuzzer ships with it: Debian's clang +
#                      libclang-rt-14-dev, deploy/install.sh). Every C and C++
#                      translation unit of the build is then compiled with
#                      -fsanitize=fuzzer-no-link,address,undefined, so the
#                      project code under test reports its coverage to the
#                      fuzzer and its memory and UB errors crash the run; each
#                      fuzz target links -fsanitize=fuzzer,address,undefined
#                      (libFuzzer's main). It replaces CACHE_DIT_SANITIZE.
#                      Use its own build folder (build-fuzz/): nothing else in
#                      such a build is meant to run.
#
#   opd_cc_fuzzer(NAME ring_record_fuzz
#                 SRCS ring_record_fuzz.cc
#                 DEPS opd_ring_codec ...
#                 [SIDE plain | torch | grpc])   # default: plain; the SIDE rule of
#                                                # opd_cc_library holds here too
include_guard(GLOBAL)

option(CACHE_DIT_FUZZ "Build the libFuzzer targets of tests/fuzz/ (clang only; instruments every C/C++ source)" OFF)
if(NOT CACHE_DIT_FUZZ)
  return()
endif()

if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang" OR NOT CMAKE_C_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "cache-dit-opd: CACHE_DIT_FUZZ needs clang (libFuzzer): configure a separate folder with "
                      "-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ (tests/fuzz/run.sh does)")
endif()
if(CACHE_DIT_SANITIZE)
  message(FATAL_ERROR "cache-dit-opd: CACHE_DIT_FUZZ brings its own sanitizers (address,undefined); "
                      "leave CACHE_DIT_SANITIZE empty in a fuzz build")
endif()

# -fno-sanitize-recover: a UBSan report is a crash, so libFuzzer keeps the
# input (otherwise it prints and goes on, and the finding is lost).
set(_opd_fuzz_flags -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
    -fno-omit-frame-pointer -g)
add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${_opd_fuzz_flags}>")
add_link_options("$<$<LINK_LANGUAGE:C,CXX>:-fsanitize=address,undefined>")
message(STATUS "cache-dit-opd: fuzz build (libFuzzer, address,undefined)")

function(opd_cc_fuzzer)
  cmake_parse_arguments(OPD "" "NAME;SIDE" "SRCS;DEPS;DEFINES" ${ARGN})
  if(NOT OPD_SIDE)
    set(OPD_SIDE plain)
  endif()
  _opd_check_side(${OPD_NAME} ${OPD_SIDE} ${OPD_DEPS})
  add_executable(${OPD_NAME} ${OPD_SRCS})
  target_compile_definitions(${OPD_NAME} PRIVATE ${OPD_DEFINES})
  target_include_directories(${OPD_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${OPD_NAME} PRIVATE ${OPD_DEPS})
  target_link_options(${OPD_NAME} PRIVATE -fsanitize=fuzzer)
  opd_target_warnings(${OPD_NAME})
endfunction()
