// File: client/python/proxy_kernel.h
//
// The native CUDA kernel of a proxy op (torch-facing half of client/python/;
// the header itself includes no torch). RegisterProxyKernel attaches one
// boxed kernel to `cache_dit_cuda_ops::<name.overload>` for the CUDA key.
// Per call it encodes the arguments into a ring record and runs the call
// through the device's NativeSession; whenever it cannot (no session,
// session failed or forked, rejections pending, CUDA graph capture, an op
// the catalog check did not cover, an argument it does not carry, a region
// not registered yet, a rejected synchronous call, a broken ring) it records
// why (native_session.h, LastFallback) and hands the call, untouched, to the
// Python implementation registered for the PrivateUse1 key of the same op,
// which acts on the reason (registers, raises, reconnects) and dispatches
// again. The native path therefore never raises on its own.
//
// Only overloads whose every return aliases a mutable argument (the .out
// overloads) get this kernel: it pushes those arguments back as the
// results, allocating nothing. A functional overload (no overload name)
// gets the functional kernel instead (functional_kernel.h), which
// allocates and calls its .out overload, so it reaches this one.
#pragma once

#include <string>

namespace cache_dit_opd::client {

// Empty on success, else why the op cannot have a native kernel.
std::string RegisterProxyKernel(const std::string& name_overload);

}  // namespace cache_dit_opd::client
