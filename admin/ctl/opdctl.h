// File: admin/ctl/opdctl.h
//
// cache-dit-opdctl: the operator's CLI of the daemon. A client like any
// other (gRPC GetVersion / GetStats / ListStore, and the session channel for drain): only
// `store rm` opens a session (deleting needs an identity), so the rest works on a
// daemon without a GPU.
//
//   cache-dit-opdctl [--gpu INDEX|UUID | --address PATH] [--runtime-dir DIR]
//                    [--json] [--timeout-ms MS] COMMAND
//
//   status [--all] [--live]  version, GPU, health and why, sessions, metrics address
//   sessions                 pid, uid, command, calls, errors, regions, mapped bytes,
//                            lanes, ring, last activity of every session
//   stats                    daemon-wide counters, stage latencies, per-op rows
//   store [ls]               the weight store's entries (ListStore of session 0):
//                            name, dtype, shape, bytes, owner uid, calls and mappings
//                            using it; bytes in use of --max-store-bytes
//   store rm NAME...         DeleteStore of each name in a session of its own, bound on
//                            the session channel (the daemon allows the entry's owner
//                            and root: server/store/weight_store.h); goes on past a
//                            name that fails, exit 1 if any did; --json: {address,
//                            deleted: [names], errors: [{name, error, reason}]}
//   drain                    stop accepting sessions, let queued calls finish, exit 0
//                            (root and the daemon's uid only: the daemon checks
//                            SO_PEERCRED on the session channel)
//
// Which daemon: --address (a socket path or unix: URI); else --gpu, by UUID
// or by CUDA ordinal of this process, found as clients find it
// (client/discovery.h; --runtime-dir searches that directory first); else
// $CACHE_DIT_OPD_ADDRESS; else the one daemon socket (`GPU-*.sock`) in the
// search directories (several: the CLI lists them and asks for --gpu).
// `status --all` reports every daemon socket of the search directories.
//
// Output: aligned tables for people; --json prints one JSON document (an
// object; an array of objects for `status --all`) whose members are the
// replies' fields by their opd.proto names, numbers as JSON numbers.
//
// Exit status: 0 done (status: every daemon asked is SERVING); 3 status
// only: every daemon answered but one is not serving (0 with --live: the
// liveness question is only "does it answer"); 1 a daemon could not be
// reached or refused the request; 2 usage.
#pragma once

#include <iosfwd>

namespace cache_dit_opd::admin {

// The whole CLI; writes results to `out` and diagnostics to `err`.
int RunOpdctl(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace cache_dit_opd::admin
