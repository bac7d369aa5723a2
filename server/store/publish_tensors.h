// File: server/store/publish_tensors.h
//
// Publishing a session's own tensors into the weight store: what the
// PublishTensors RPC does, on the store's thread. Each tensor is a dense
// view in one of the session's regions (client memory it registered, or an
// attached store block); the daemon copies it device to device into the new
// set's block while its region is pinned (RegionRegistry::PinForCopy), so
// the client may free its copy once the call has returned. The client must
// have finished writing the tensors before it asks (its stream synchronized):
// the copy is not ordered after the client's GPU work.
#pragma once

#include <string>
#include <vector>

#include "common/call.h"
#include "common/status.h"
#include "server/session/peer_policy.h"
#include "server/session/region_registry.h"
#include "server/store/weight_store.h"

namespace cache_dit_opd::server {

struct NamedTensor {
  std::string name;  // the store name (the client's prefix included)
  TensorRef tensor;
};

// Checks every view (a wire dtype, at most kMaxTensorDims dims, sizes >= 0,
// contiguous, aligned to its element, inside its region), pins the regions,
// publishes the set (WeightStore::Publish) with each entry copied from its
// view, unpins. `out`: the set, in `tensors` order. Errors: BAD_ARGUMENT
// naming the tensor and the value, REGION_UNKNOWN naming the tensor and the
// region, the store's (weight_store.h); at most kMaxPublishTensors tensors.
Status PublishTensors(WeightStore& store, const PeerCred& owner, RegionRegistry& regions,
                      const std::vector<NamedTensor>& tensors, const std::vector<uid_t>& readers,
                      std::vector<StoreEntryInfo>* out);

}  // namespace cache_dit_opd::server
