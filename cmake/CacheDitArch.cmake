# CUDA target resolution and op-family gating.
#
# cache_dit_resolve_arch_list(<out>)
#   Reads, in order: the CACHE_DIT_CUDA_ARCH_LIST cache variable, the
#   CACHE_DIT_CUDA_ARCH_LIST environment variable, TORCH_CUDA_ARCH_LIST (CMake
#   or environment), else the default "89;90a;100;120a". Accepts torch's
#   spelling ("8.9 9.0a+PTX") and names (ada, hopper, blackwell) and returns a
#   CMake list of SM codes such as "89;90a".
#
# cache_dit_resolve_families(<archs>)
#   Decides which families build and for which targets. Sets in the caller:
#   CACHE_DIT_FAMILIES (subset of "attn;comm;svdq") and CACHE_DIT_KERNEL_ARCHS
#   (the targets of the kernel library, ready for CUDA_ARCHITECTURES).
#   A family set to ON that resolves to no target is a configure error naming
#   the variable to set; AUTO skips it with a message.

set(CACHE_DIT_DEFAULT_CUDA_ARCHS "89;90a;100;120a")

function(cache_dit_resolve_arch_list out)
  set(raw "${CACHE_DIT_CUDA_ARCH_LIST}")
  set(source "CACHE_DIT_CUDA_ARCH_LIST")
  if(raw STREQUAL "" AND DEFINED ENV{CACHE_DIT_CUDA_ARCH_LIST})
    set(raw "$ENV{CACHE_DIT_CUDA_ARCH_LIST}")
    set(source "CACHE_DIT_CUDA_ARCH_LIST (environment)")
  endif()
  if(raw STREQUAL "" AND DEFINED TORCH_CUDA_ARCH_LIST AND NOT TORCH_CUDA_ARCH_LIST STREQUAL "")
    set(raw "${TORCH_CUDA_ARCH_LIST}")
    set(source "TORCH_CUDA_ARCH_LIST")
  endif()
  if(raw STREQUAL "" AND DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(raw "$ENV{TORCH_CUDA_ARCH_LIST}")
    set(source "TORCH_CUDA_ARCH_LIST (environment)")
  endif()
  if(raw STREQUAL "")
    set(raw "${CACHE_DIT_DEFAULT_CUDA_ARCHS}")
    set(source "default")
  endif()

  string(TOLOWER "${raw}" raw)
  string(REGEX REPLACE "[ ,]+" ";" raw "${raw}")
  set(result "")
  foreach(item IN LISTS raw)
    string(REPLACE "+ptx" "" item "${item}")
    string(REPLACE "sm_" "" item "${item}")
    string(REPLACE "." "" item "${item}")
    if(item STREQUAL "")
      continue()
    elseif(item STREQUAL "ada")
      set(item 89)
    elseif(item STREQUAL "hopper")
      set(item 90a)
    elseif(item STREQUAL "blackwell")
      set(item 100)
    endif()
    if(NOT item MATCHES "^[0-9]+[af]?$")
      message(FATAL_ERROR "CUDA target '${item}' from ${source} is not an SM code "
                          "(expected e.g. 89, 90a, 100, 120a); fix CACHE_DIT_CUDA_ARCH_LIST")
    endif()
    list(APPEND result "${item}")
  endforeach()
  list(REMOVE_DUPLICATES result)
  message(STATUS "cache-dit-opd: CUDA targets ${result} (from ${source})")
  set(${out} "${result}" PARENT_SCOPE)
endfunction()

# SM number of a code such as "90a" -> 90.
function(_cache_dit_sm_number code out)
  string(REGEX MATCH "^[0-9]+" n "${code}")
  set(${out} "${n}" PARENT_SCOPE)
endfunction()

function(_cache_dit_gate family request archs min_sm out_archs out_on)
  set(kept "")
  set(dropped "")
  foreach(a IN LISTS archs)
    _cache_dit_sm_number("${a}" n)
    if(n GREATER_EQUAL ${min_sm})
      list(APPEND kept "${a}")
    else()
      list(APPEND dropped "${a}")
    endif()
  endforeach()
  string(TOUPPER "${request}" request)
  set(on FALSE)
  if(request STREQUAL "OFF" OR request STREQUAL "FALSE" OR request STREQUAL "0")
    message(STATUS "cache-dit-opd: ${family} family off")
  elseif(kept STREQUAL "")
    if(request STREQUAL "AUTO")
      message(STATUS "cache-dit-opd: ${family} family skipped: no CUDA target is sm_${min_sm} "
                     "or newer (targets: ${archs})")
    else()
      message(FATAL_ERROR "cache-dit-opd: the ${family} family was requested but none of the CUDA "
                          "targets '${archs}' is sm_${min_sm} or newer. Set CACHE_DIT_CUDA_ARCH_LIST "
                          "(or TORCH_CUDA_ARCH_LIST) to include one, e.g. -DCACHE_DIT_CUDA_ARCH_LIST=90a")
    endif()
  else()
    set(on TRUE)
    if(dropped)
      message(STATUS "cache-dit-opd: ${family} family builds for ${kept}; "
                     "not for ${dropped} (needs sm_${min_sm}+)")
    else()
      message(STATUS "cache-dit-opd: ${family} family builds for ${kept}")
    endif()
  endif()
  set(${out_archs} "${kept}" PARENT_SCOPE)
  set(${out_on} ${on} PARENT_SCOPE)
endfunction()

function(cache_dit_resolve_families archs)
  # The merge and FP8 kernels use the sm_89 FP8 conversions (cvt.*.e4m3x2);
  # the W4A4 kernels need sm_80 (mma.sync on the model dtype for LoRA; FP8
  # wgmma on sm_90a, CUDA cores elsewhere: docs/DESIGN.md section 8).
  _cache_dit_gate(attn "${CACHE_DIT_BUILD_ATTN}" "${archs}" 89 attn_archs attn_on)
  _cache_dit_gate(comm "${CACHE_DIT_BUILD_COMM}" "${archs}" 89 comm_archs comm_on)
  _cache_dit_gate(svdq "${CACHE_DIT_BUILD_SVDQUANT}" "${archs}" 80 svdq_archs svdq_on)

  set(families "")
  set(kernel_archs "")
  foreach(family attn comm svdq)
    if(${family}_on)
      list(APPEND families ${family})
      list(APPEND kernel_archs ${${family}_archs})
    endif()
  endforeach()
  if(svdq_on)
    foreach(a IN LISTS svdq_archs)
      _cache_dit_sm_number("${a}" n)
      if(a STREQUAL "90a")
        message(STATUS "cache-dit-opd: svdq: sm_90a: INT4 values on FP8 e4m3 wgmma (kernels/svdq/gemm_sm90.h)")
      elseif(n GREATER_EQUAL 90)
        message(STATUS "cache-dit-opd: svdq: sm_${a}: the portable CUDA-core GEMM (INT4 mma is emulated there)")
      endif()
    endforeach()
  endif()

  list(REMOVE_DUPLICATES kernel_archs)
  set(CACHE_DIT_FAMILIES "${families}" PARENT_SCOPE)
  set(CACHE_DIT_KERNEL_ARCHS "${kernel_archs}" PARENT_SCOPE)
endfunction()
