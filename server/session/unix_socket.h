// File: server/session/unix_socket.h
//
// The daemon's listening Unix sockets (gRPC, session channel): one way to
// create them, so each has mode 0660 from its first moment.
#pragma once

#include <string>

#include "common/status.h"

namespace cache_dit_opd {

// ListenUnix
//
// A socket of `type` (SOCK_STREAM, SOCK_SEQPACKET; close-on-exec,
// non-blocking) bound to `path` with mode 0660 and listening with
// `backlog`. On success *fd is the socket and *created says the file was
// made (the caller unlinks it); on failure *fd is closed and -1, and
// *created says whether the file was made before the failure.
// INVALID_ARGUMENT for a path too long for sockaddr_un, INTERNAL naming the
// call that failed otherwise.
Status ListenUnix(const std::string& path, int type, int backlog, int* fd, bool* created);

}  // namespace cache_dit_opd
