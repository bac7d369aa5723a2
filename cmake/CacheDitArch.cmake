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
  set(attn_req "${CACHE_DIT_BUILD_ATTN}")
  set(comm_req "${CACHE_DIT_BUILD_COMM}")
  string(TOUPPER "${CACHE_DIT_BUILD_SVDQUANT}" svdq_req)
  if(svdq_req STREQUAL "ON" OR svdq_req STREQUAL "TRUE" OR svdq_req STREQUAL "1")
    message(STATUS "cache-dit-opd: CACHE_DIT_BUILD_SVDQUANT=ON turns on the attn and comm families")
    set(attn_req ON)
    set(comm_req ON)
  endif()

  # The merge and FP8 kernels use the sm_89 FP8 conversions (cvt.*.e4m3x2).
  _cache_dit_gate(attn "${attn_req}" "${archs}" 89 attn_archs attn_on)
  _cache_dit_gate(comm "${comm_req}" "${archs}" 89 comm_archs comm_on)

  set(families "")
  set(kernel_archs "")
  if(attn_on)
    list(APPEND families attn)
    list(APPEND kernel_archs ${attn_archs})
  endif()
  if(comm_on)
    list(APPEND families comm)
    list(APPEND kernel_archs ${comm_archs})
  endif()

  if(NOT svdq_req STREQUAL "OFF" AND NOT svdq_req STREQUAL "FALSE" AND NOT svdq_req STREQUAL "0")
    # Per target, what the W4A4 family would run (docs/DESIGN.md section 8). No
    # target is dropped without saying so.
    set(svdq_archs "")
    foreach(a IN LISTS archs)
      _cache_dit_sm_number("${a}" n)
      if(n LESS 80)
        message(STATUS "cache-dit-opd: svdq: sm_${a} dropped: W4A4 needs sm_80+ (mma.sync s4/s8)")
      elseif(n LESS 90)
        message(STATUS "cache-dit-opd: svdq: sm_${a}: native INT4 mma.sync")
        list(APPEND svdq_archs "${a}")
      else()
        message(STATUS "cache-dit-opd: svdq: sm_${a}: INT4 data on INT8 tensor cores (INT4 mma is emulated there)")
        list(APPEND svdq_archs "${a}")
      endif()
    endforeach()
    if(svdq_archs STREQUAL "" AND (svdq_req STREQUAL "ON" OR svdq_req STREQUAL "TRUE" OR svdq_req STREQUAL "1"))
      message(FATAL_ERROR "cache-dit-opd: CACHE_DIT_BUILD_SVDQUANT=ON but no CUDA target is sm_80 or "
                          "newer; set CACHE_DIT_CUDA_ARCH_LIST (or TORCH_CUDA_ARCH_LIST)")
    endif()
    message(STATUS "cache-dit-opd: svdq: no W4A4 kernels in this tree yet; the family adds no sources")
  endif()

  list(REMOVE_DUPLICATES kernel_archs)
  set(CACHE_DIT_FAMILIES "${families}" PARENT_SCOPE)
  set(CACHE_DIT_KERNEL_ARCHS "${kernel_archs}" PARENT_SCOPE)
endfunction()
