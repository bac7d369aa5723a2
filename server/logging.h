// File: server/logging.h
//
// spdlog set-up for the daemon: one logger, to stderr (journald adds time
// and pid under systemd; the pattern keeps a timestamp for other runs).
// Code logs with spdlog::info(...) etc.; this file only configures.
#pragma once

#include <string>

#include "common/status.h"

namespace cache_dit_opd {

// InitLogging
//
// Installs the default logger at `level` (trace ... off). INVALID_ARGUMENT
// on an unknown level.
Status InitLogging(const std::string& level);

}  // namespace cache_dit_opd
