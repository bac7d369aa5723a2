// File: common/out_of_descriptors.h
//
// The errno values (of accept4, dup) that mean the process or the system is
// out of descriptors or memory, for every listening socket the daemon polls
// (the session channel, the metrics endpoint). After accept4 fails so, the
// pending connection stays queued and the listening socket readable:
// polling it again at once would spin a core, so the caller pauses
// accepting instead.
#pragma once

#include <cerrno>

namespace cache_dit_opd {

inline bool OutOfDescriptors(int err) {
  return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

}  // namespace cache_dit_opd
