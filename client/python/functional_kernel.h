// File: client/python/functional_kernel.h
//
// The native CUDA kernel of a functional overload (`<op>`, the allocating
// form users call; torch-facing half of client/python/, the header itself
// includes no torch). Per call it validates the arguments and allocates the
// outputs with the op's own Meta kernel (kernels/ops.h: the one check
// function per op that the kernel library and the daemon run, so a bad
// argument raises the same ValueError naming it), on the arguments' device
// through the caching allocator of the current stream, then calls
// `<op>.out` through the dispatcher, whose CUDA kernel is the proxy kernel
// (proxy_kernel.h): the call runs over the ring natively, or goes to the
// Python implementation with its reason (no session yet, a region to
// register, graph capture, a rejection to raise). A call whose outputs are
// all empty stops after the allocation, as the Python implementation does.
// It never talks to the daemon itself.
#pragma once

#include <string>

namespace cache_dit_opd::client {

// Empty on success (or when it has it already), else why `name` (a
// functional overload) cannot have the native kernel (kernels/ops.def does
// not list it, or the op or its .out overload is not defined).
std::string RegisterFunctionalKernel(const std::string& name);

// Takes the native kernel of `name` out of the dispatcher again; false when
// it had none. For an op whose definition is about to go (the Python client
// gives cache-dit's svdq ops back): a kernel left registered would become
// the CUDA kernel of the next definition of that name.
bool UnregisterFunctionalKernel(const std::string& name);

}  // namespace cache_dit_opd::client
