#include "server/grpc/proto_convert.h"

#include "common/call_proto.h"

namespace cache_dit_opd {
OpenSessionParams FromProto(const v1::OpenSessionRequest& in) {
  OpenSessionParams p;
  p.protocol_version = in.protocol_version();
  p.client_pid = in.client_pid();
  p.gpu_uuid = in.gpu_uuid();
  p.lanes = in.lanes();
  p.client_name = in.client_name();
  p.want_ring = in.want_ring();
  return p;
}

void ToProto(const VersionInfo& in, v1::VersionReply* out) {
  out->set_daemon_version(in.info.daemon_version);
  out->set_protocol_version(in.protocol_version);
  out->set_git_commit(in.info.git_commit);
  out->set_torch_version(in.info.torch_version);
  out->set_cuda_runtime_version(in.info.cuda_runtime_version);
  out->set_cuda_driver_version(in.info.cuda_driver_version);
  out->set_device_index(in.info.device_index);
  out->set_gpu_uuid(in.info.gpu_uuid);
  out->set_gpu_name(in.info.gpu_name);
  out->set_serving(in.serving);
  out->set_not_serving_reason(in.not_serving_reason);
  out->set_layout_version(in.layout_version);
  out->set_ring_available(in.ring_available);
  out->set_daemon_pid(in.daemon_pid);
  out->set_daemon_uid(in.daemon_uid);
  out->set_metrics_address(in.metrics_address);
  out->set_health_reason(static_cast<v1::Reason>(in.health_reason));
  out->set_uptime_ms(in.uptime_ms);
  out->set_session_channel_path(in.session_channel_path);
}

void ToProto(const OpenSessionResult& in, v1::OpenSessionReply* out) {
  out->set_session_id(in.session_id);
  out->set_token(std::string(reinterpret_cast<const char*>(in.token.data()), in.token.size()));
  for (const OpInfo& op : in.catalog) {
    v1::OpSchema* s = out->add_catalog();
    s->set_name(op.name);
    s->set_overload(op.overload);
    s->set_schema(op.schema);
  }
  out->set_session_channel_path(in.session_channel_path);
  out->set_lanes(in.lanes);
  out->set_layout_version(in.layout_version);
  out->set_shared_memory_bytes(in.shared_memory_bytes);
  out->set_ring_enabled(in.ring_enabled);
  out->set_gpu_uuid(in.gpu_uuid);
  out->set_device_index(in.device_index);
  out->set_bind_timeout_ms(in.bind_timeout_ms);
}

void ToProto(const StatsSnapshot& in, v1::StatsReply* out) {
  out->set_sessions(in.sessions);
  out->set_calls(in.calls);
  out->set_errors(in.errors);
  out->set_regions(in.regions);
  out->set_mapped_bytes(in.mapped_bytes);
  out->set_call_p50_us(in.call_p50_us);
  out->set_call_p99_us(in.call_p99_us);
  out->set_sessions_closed(in.sessions_closed);
  out->set_store_entries(in.store_entries);
  out->set_store_bytes(in.store_bytes);
  out->set_max_store_bytes(in.store_max_bytes);
  out->set_executor_threads(in.executor_threads);
  for (uint64_t ns : in.executor_busy_ns) out->add_executor_busy_ns(ns);
  for (const SessionStatsEntry& e : in.sessions_detail) {
    v1::SessionStats* s = out->add_session();
    s->set_session_id(e.session_id);
    s->set_client_pid(e.client_pid);
    s->set_client_uid(e.client_uid);
    s->set_calls(e.calls);
    s->set_errors(e.errors);
    s->set_regions(e.regions.regions);
    s->set_mapped_bytes(e.regions.mapped_bytes);
    s->set_pending_unmaps(e.regions.pending_unmaps);
    s->set_lanes(e.lanes);
    s->set_client_name(e.client_name);
    s->set_command(e.command);
    s->set_bound(e.bound);
    s->set_ring_slots(e.ring_slots);
    s->set_ring_pending(e.ring_pending);
    s->set_idle_ms(e.idle_ms);
    s->set_age_ms(e.age_ms);
    s->set_executor(e.executor);
  }
  for (const OpStatsEntry& e : in.ops) {
    v1::OpStats* o = out->add_ops();
    o->set_name(e.name);
    o->set_overload(e.overload);
    o->set_transport(CallTransportName(e.transport));
    o->set_calls(e.calls);
    o->set_rejections(e.rejections);
    o->set_accept_mean_us(e.stage_mean_us[static_cast<size_t>(CallStage::kAccept)]);
    o->set_inputs_wait_mean_us(e.stage_mean_us[static_cast<size_t>(CallStage::kInputsWait)]);
    o->set_run_mean_us(e.stage_mean_us[static_cast<size_t>(CallStage::kRun)]);
    o->set_total_mean_us(e.stage_mean_us[static_cast<size_t>(CallStage::kTotal)]);
  }
  for (const StatsSnapshot::Stage& st : in.stages) {
    v1::StageLatency* s = out->add_stages();
    s->set_name(st.name);
    s->set_p50_us(st.p50_us);
    s->set_p99_us(st.p99_us);
    s->set_count(st.count);
  }
}

server::PublishFileParams FromProto(const v1::PublishFileRequest& in) {
  server::PublishFileParams p;
  p.path = in.path();
  p.prefix = in.prefix();
  p.tensors.assign(in.tensors().begin(), in.tensors().end());
  p.readers.assign(in.reader_uids().begin(), in.reader_uids().end());
  return p;
}

void ToProto(const server::StoreEntryInfo& in, v1::StoreEntry* out) {
  out->set_name(in.name);
  out->set_dtype(static_cast<v1::DType>(in.dtype));
  for (int64_t d : in.shape) out->add_shape(d);
  out->set_bytes(in.bytes);
  out->set_owner_uid(in.owner);
  out->set_refs(in.refs);
  out->set_set_id(in.publish_id);
  out->set_block_bytes(in.block_bytes);
  out->set_offset(in.offset);
}

Status FromProto(const v1::PublishTensorsRequest& in, std::vector<server::NamedTensor>* tensors,
                 std::vector<uid_t>* readers) {
  tensors->clear();
  tensors->reserve(in.tensors_size());
  for (int i = 0; i < in.tensors_size(); ++i) {
    const v1::NamedTensor& t = in.tensors(i);
    server::NamedTensor n;
    n.name = t.name();
    OPD_RETURN_IF_ERROR(TensorFromProto("tensor " + std::to_string(i), t.tensor(), &n.tensor));
    tensors->push_back(std::move(n));
  }
  readers->assign(in.reader_uids().begin(), in.reader_uids().end());
  return Status::Ok();
}

}  // namespace cache_dit_opd
