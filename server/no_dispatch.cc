// Build fallback, linked into cache-dit-opd only when the opd_dispatch
// target does not exist (server/dispatch/ not built yet): the daemon then
// serves no ops, and every call fails UNIMPLEMENTED saying why. The real
// implementation is server/dispatch/ (target opd_dispatch).
#include "server/dispatch/torch_call_runner.h"

namespace cache_dit_opd {

std::vector<OpInfo> ListOps() { return {}; }

Status LoadOpLibrary(const std::string& path) {
  return Status::Unimplemented("cannot load ", path, ": this daemon was built without the dispatch layer");
}

Status PrepareCall(const CallRequest& req, const RegionResolver&, bool, std::unique_ptr<PreparedCall>*) {
  return Status::Unimplemented("op ", req.op, ": this daemon was built without the dispatch layer");
}

Status RunCall(PreparedCall&, void*, bool*) {
  return Status::Unimplemented("this daemon was built without the dispatch layer");
}

}  // namespace cache_dit_opd
