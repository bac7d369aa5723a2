#include "server/logging.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

namespace cache_dit_opd {

Status InitLogging(const std::string& level) {
  spdlog::level::level_enum lvl = spdlog::level::from_str(level);
  if (lvl == spdlog::level::off && level != "off") {
    return Status::InvalidArgument("log level '", level, "' is unknown");
  }
  auto logger = spdlog::stderr_logger_mt("cache-dit-opd");
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %l [%t] %v");
  logger->set_level(lvl);
  // Warnings and errors must reach the journal even if the daemon dies next.
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
  return Status::Ok();
}

}  // namespace cache_dit_opd
